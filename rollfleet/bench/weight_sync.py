"""Weight-sync bandwidth against the raw ceiling of the same path, measured in the same run.

    rollfleet bench weight-sync --transport {tensor,nccl,disk} --size-gb X [--device cuda|cpu]

A Qwen3-shaped model of about X GB lives in this process (the "trainer", GPU 0 or CPU); one
embedded engine is started (tensor: on the same GPU; nccl and disk: on GPU 1 when there is one).
Raw ceiling: nccl = plain broadcasts of the same buckets to a bare receiver process on the
engine's device; tensor = a device-to-device copy of the same bytes; disk = reading the saved
files into the engine's device. Full sync = gather + pack + send + engine load, then the
fingerprint check, timed end to end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from rollfleet.config import DiskSync, NcclSync, TensorSync
from rollfleet.engine.launch import EngineProcess, embedded_argv
from rollfleet.engine.server import dump_stacks_if_hung
from rollfleet.tiny_models import make_tokenizer, tiny_config
from rollfleet.weights.checkpoint import save_checkpoint
from rollfleet.weights.source import ModuleSource
from rollfleet.weights.transports import EngineTarget, make_transport
from rollfleet.weights.verify import find_unverified
from rollfleet.wire.buckets import iter_buckets
from rollfleet.wire.client import EngineClient
from rollfleet.wire.group import join_weight_update_group
from rollfleet.wire.net import free_port


def model_for(size_gb: float, dtype: torch.dtype, device: str):
    """A Qwen3-shaped model of about size_gb, built directly on `device`."""
    bytes_per = torch.finfo(dtype).bits // 8
    hidden = 4096 if size_gb >= 12 else 2048 if size_gb >= 1 else 256  # 8B-class models have hidden 4096
    per_layer = 12 * hidden * hidden * bytes_per  # attention 4h^2 (GQA ~3h^2) + MLP 3*h*4h
    layers = max(1, round(size_gb * 1e9 / per_layer))
    config = tiny_config(
        "qwen3",
        vocab_size=len(make_tokenizer()),
        hidden_size=hidden,
        num_hidden_layers=layers,
        intermediate_size=4 * hidden,
        num_attention_heads=hidden // 128 if hidden >= 1024 else 4,
        num_key_value_heads=max(2, hidden // 512),
        head_dim=128 if hidden >= 1024 else 64,
    )
    torch.manual_seed(0)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def _raw_receiver(rank, port, total_bytes_per_bucket, device, backend):
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    group = join_weight_update_group("127.0.0.1", port, 1, 2, "raw", backend, timedelta(seconds=60))
    dist.broadcast(torch.empty(1, device=device), group=group, group_src=0)  # warm-up: connections, communicator
    for size in total_bytes_per_bucket:
        dist.broadcast(torch.empty(size, dtype=torch.uint8, device=device), group=group, group_src=0)
    dist.all_reduce(torch.zeros(1, device=device), group=group)  # "all received", for the sender's clock
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def raw_broadcast(buckets: list[torch.Tensor], device: str, receiver_device: str, backend: str) -> float:
    port = free_port()
    context = mp.get_context("spawn")
    proc = context.Process(target=_raw_receiver, args=(1, port, [b.numel() for b in buckets], receiver_device, backend))
    proc.start()
    group = join_weight_update_group("127.0.0.1", port, 0, 2, "raw", backend, timedelta(seconds=60))
    dist.broadcast(torch.zeros(1, device=device), group=group, group_src=0)
    start = time.perf_counter()
    for bucket in buckets:
        dist.broadcast(bucket, group=group, group_src=0)
    dist.all_reduce(torch.zeros(1, device=device), group=group)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    proc.join()
    dist.destroy_process_group(group)
    return seconds


def raw_copy(buckets: list[torch.Tensor]) -> float:
    largest = max(b.numel() for b in buckets)
    targets = [torch.empty(largest, dtype=torch.uint8, device=buckets[0].device) for _ in range(2)]
    for _ in range(2):  # warm-up, then timed
        start = time.perf_counter()
        for i, bucket in enumerate(buckets):
            targets[i % 2][: bucket.numel()].copy_(bucket)
        if bucket.is_cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    return seconds


def raw_read(directory: Path, device: str) -> float:
    start = time.perf_counter()
    for file in sorted(directory.glob("*.safetensors")):
        load_file(file, device=device)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - start


async def _verify(url, report):
    async with EngineClient(url, timeout=600) as client:
        return await find_unverified(report, {0: client})


async def _memory(url):
    async with EngineClient(url, timeout=600) as client:
        return await client.memory()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="rollfleet bench weight-sync")
    parser.add_argument("--transport", choices=["tensor", "nccl", "disk"], required=True)
    parser.add_argument("--size-gb", type=float, default=0.05)
    parser.add_argument("--bucket-mb", type=float, default=512)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeat", type=int, default=3, help="timed syncs after the cold one (median reported)")
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    parser.add_argument("--log-dir", default=None, help="keep the engine's log here")
    args = parser.parse_args(argv)
    dump_stacks_if_hung()
    gpu = args.device == "cuda"
    sender_device = "cuda:0" if gpu else "cpu"
    engine_gpu = 0 if args.transport == "tensor" or torch.cuda.device_count() < 2 else 1
    engine_device = f"cuda:{engine_gpu}" if gpu else "cpu"
    dtype = torch.bfloat16 if gpu else torch.float32
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        say = lambda what: print(f"[bench {time.strftime('%X')}] {what}", flush=True)  # noqa: E731
        say("building the model")
        model = model_for(args.size_gb, dtype, sender_device)
        model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        save_checkpoint(ModuleSource(model).named_tensors(), scratch / "model", None)
        make_tokenizer().save_pretrained(scratch / "model")
        model.config.save_pretrained(scratch / "model")
        with torch.no_grad():  # the trainer's "new" weights differ from the engine's
            for param in model.parameters():
                param.add_(torch.randn_like(param) * 1e-3)
        buckets = [
            b.flattened_tensor.view(torch.uint8)
            for b in iter_buckets(ModuleSource(model).named_tensors(), int(args.bucket_mb * (1 << 20)))
        ]
        say("measuring the raw ceiling")
        if args.transport == "nccl":
            raw_seconds = raw_broadcast(buckets, sender_device, engine_device, "nccl" if gpu else "gloo")
            raw_name = "plain broadcast of the same buckets"
        elif args.transport == "tensor":
            raw_seconds = raw_copy(buckets)
            raw_name = "device copy of the same bytes"
        else:
            raw_seconds = raw_read(scratch / "model", engine_device)
            raw_name = "reading the checkpoint files"
        del buckets
        if gpu:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(0)
        sender_before = torch.cuda.memory_allocated(0) if gpu else 0
        port = free_port()
        extra = ["--device", args.device, "--base-gpu-id", str(engine_gpu), "--dtype", "bfloat16" if gpu else "float32"]
        engine = EngineProcess(
            embedded_argv(str(scratch / "model"), port, extra=extra),
            port=port,
            log_path=Path(args.log_dir or scratch) / f"engine-{args.transport}.log",
        )
        try:
            say("starting the engine")
            engine.wait_until_up(timeout=600)
            say("engine up; connecting")
            spec = {
                "tensor": TensorSync(bucket_mb=args.bucket_mb),
                "nccl": NcclSync(bucket_mb=args.bucket_mb, join_timeout_s=60),
                "disk": DiskSync(path=str(scratch / "sync")),
            }[args.transport]
            target = EngineTarget(engine_id=0, url=engine.url, num_ranks=1, rank_offset=1, dtype=dtype)
            options = {"config_dir": str(scratch / "model")} if args.transport == "disk" else {}
            transport = make_transport(spec, [target], **options)
            transport.connect()
            say("sending (cold, then timed)")
            cold = time.perf_counter()
            transport.send(ModuleSource(model), "cold")  # first send: lazy communicator set-up, allocations
            cold_seconds = time.perf_counter() - cold
            sends, fulls = [], []
            for repeat in range(args.repeat):  # steady state: a run keeps its transport connected across steps
                start = time.perf_counter()
                report = transport.send(ModuleSource(model), str(repeat + 1))
                sends.append(time.perf_counter() - start)
                problems = asyncio.run(_verify(engine.url, report))
                fulls.append(time.perf_counter() - start)
                say("phases (s): " + ", ".join(f"{k} {v:.4f}" for k, v in report.phases.items()))
                if problems:
                    break
            engine_memory = asyncio.run(_memory(engine.url))
            send_seconds, full_seconds = statistics.median(sends), statistics.median(fulls)
            say(f"sent and verified in {full_seconds:.3f} s (cold send {cold_seconds:.3f} s); disconnecting")
            transport.disconnect()
        finally:
            engine.stop()
    figures = {
        "transport": args.transport,
        "device": args.device,
        "model_gb": round(model_bytes / 1e9, 3),
        "bucket_mb": args.bucket_mb,
        "raw_path": raw_name,
        "raw_gb_per_s": round(model_bytes / raw_seconds / 1e9, 2),
        "sync_gb_per_s": round(model_bytes / send_seconds / 1e9, 2),
        "first_sync_gb_per_s": round(model_bytes / cold_seconds / 1e9, 2),
        "sync_plus_verify_gb_per_s": round(model_bytes / full_seconds / 1e9, 2),
        "ratio_sync_to_raw": round(raw_seconds / send_seconds, 3),
        "ratio_sync_plus_verify_to_raw": round(raw_seconds / full_seconds, 3),
        "verified": not problems,
        "sync_seconds": [round(x, 4) for x in sends],
        "raw_seconds": round(raw_seconds, 4),
        "verify_seconds": [round(full - send, 4) for send, full in zip(sends, fulls)],
        "phases_last_sync": {k: round(v, 4) for k, v in report.phases.items()},
        "sender_peak_extra_gb": round((torch.cuda.max_memory_allocated(0) - sender_before) / 1e9, 2) if gpu else None,
        "engine_memory": engine_memory,
    }
    print(f"weight sync over {args.transport} ({args.device}), {figures['model_gb']} GB in {args.bucket_mb} MB buckets")
    print(f"  raw ceiling ({raw_name}): {figures['raw_gb_per_s']:8.2f} GB/s")
    print(f"  full sync (gather, pack, send, load):      {figures['sync_gb_per_s']:8.2f} GB/s")
    print(f"  full sync + fingerprint verification:      {figures['sync_plus_verify_gb_per_s']:8.2f} GB/s")
    print(f"  first sync of the run (cold):              {figures['first_sync_gb_per_s']:8.2f} GB/s")
    print(f"  ratio full sync / raw:                     {figures['ratio_sync_to_raw']:8.3f}")
    print(f"  ratio full sync + verification / raw:      {figures['ratio_sync_plus_verify_to_raw']:8.3f}")
    print(f"  timed syncs (s): {figures['sync_seconds']} (median of {len(sends)}); raw {figures['raw_seconds']} s")
    print(f"  verification (s): {figures['verify_seconds']}")
    print(f"  verified by fingerprint:                   {figures['verified']}  {problems or ''}")
    if gpu:
        print(f"  sender peak extra GPU memory:              {figures['sender_peak_extra_gb']} GB")
        print(f"  engine memory:                             {engine_memory}")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))
    if problems:
        raise SystemExit(f"the engine does not hold what was sent: {problems}")


if __name__ == "__main__":
    main()
