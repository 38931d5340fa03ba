"""Weight-sync bandwidth against the raw ceiling of the same path, measured in the same run.

    rollfleet bench weight-sync --transport {tensor,nccl,disk,lora} --size-gb X [--repeats 5] [--json F]

A model of the benchmarks' shape (rollfleet.bench.shapes: vocab 151,936 by default, `--vocab`) of
about X GB lives in this process (the "trainer", GPU 0 or CPU); one
embedded engine is started (tensor: on the same GPU; nccl and disk: on GPU 1 when there is one).
Raw ceiling (rollfleet/bench/raw_ceiling.py): nccl = plain broadcasts of the same buckets to a
bare receiver process on the engine's device; tensor = a device-to-device copy of the same bytes;
disk = reading the saved files onto the engine's device; lora = a device-to-device copy of the
adapter's bytes. lora: the model gets a peft adapter of `--lora-rank` on `--lora-targets` (the
trainer's defaults: q, k, v, o; fp32 as peft keeps it), perturbed each repeat, pushed to an engine
on the same device started with --enable-lora. Both the ceiling and the sync are measured
warm (one untimed pass first, the ceiling's buffers allocated before timing) and repeated the same
number of times; the ratio is median raw seconds / median sync seconds, with min/median/max of each.

Sync = gather + pack + send + engine load, on a transport connected once (as a run keeps it).
Verify = the fleet's fingerprint check (a fresh client, as the fleet does), timed after each sync.
Before each timed sync the bench waits for the work the last one left running off its path (lora:
its adapter directory, `Transport.settle`), which in a run overlaps the train step between syncs and
here would land on the next sync: timed apart ("left running").
A run whose verification fails prints no figures, writes a record marked not ok, and exits non-zero.
Each phase of the sender (`SyncReport.phases`: source, fingerprint, pack, serialize, wait_engines or
load, ...) is printed in ms (median over the repeats) beside the raw copy of the same bytes.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import tempfile
import time
from pathlib import Path

import torch

from rollfleet.bench.raw_ceiling import measure_raw, model_for
from rollfleet.bench.record import command_line, make_record, spread, start, write_record
from rollfleet.bench.shapes import add_vocab_flag, bench_tokenizer
from rollfleet.config import DiskSync, LoraSync, NcclSync, TensorSync
from rollfleet.engine.process.launch import EngineProcess, embedded_argv
from rollfleet.engine.process.server import dump_stacks_if_hung
from rollfleet.engine.process.zygote_client import Zygote
from rollfleet.weights.adapter import LoraSource
from rollfleet.weights.checkpoint import save_checkpoint
from rollfleet.weights.source import ModuleSource
from rollfleet.weights.transports import EngineTarget, make_transport
from rollfleet.weights.transports.lora import LoraTransport
from rollfleet.weights.verify import find_unverified
from rollfleet.wire.buckets import iter_buckets
from rollfleet.wire.client import EngineClient
from rollfleet.wire.net import free_port


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="rollfleet bench weight-sync")
    parser.add_argument("--transport", choices=["tensor", "nccl", "disk", "lora"], required=True)
    parser.add_argument("--size-gb", type=float, default=0.05)
    parser.add_argument("--bucket-mb", type=float, default=512)
    add_vocab_flag(parser)
    parser.add_argument(
        "--hidden",
        type=int,
        default=None,
        help="hidden size (default by size: 256 under 1 GB); a small one with --vocab 320 keeps a real model's "
        "tensor count (24 layers: --hidden 64 --size-gb 0.0049) at a size where the fixed costs show",
    )
    parser.add_argument(
        "--packed",
        action="store_true",
        help="tensor: pack every push into buckets (weight_sync.resident=false) instead of mapping the "
        "parameters into the engine once",
    )
    parser.add_argument("--lora-rank", type=int, default=32, help="lora: the adapter's rank")
    parser.add_argument(
        "--lora-targets", nargs="+", default=["q_proj", "k_proj", "v_proj", "o_proj"], help="lora: target modules"
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--repeats", "--repeat", type=int, default=5, help="timed passes of the ceiling and timed syncs (after warm-up)"
    )
    parser.add_argument("--json", default=None, help="write the record (rollfleet/bench/record.py) to this file")
    parser.add_argument("--log-dir", default=None, help="keep the engine's log here")
    parser.add_argument(
        "--tamper-for-test",
        action="store_true",
        help="test knob: after each send, reload the engine's original checkpoint under the same version, so the "
        "engine does not hold what was sent and verification must fail",
    )
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    return args


def _say(what: str) -> None:
    print(f"[bench {time.strftime('%X')}] {what}", flush=True)


def _prepare(args, scratch: Path, dtype: torch.dtype, device: str):
    """The sender's model (saved first, as the engine's starting weights, then perturbed; lora: wrapped
    with a peft adapter, the base kept) and the buckets of what a sync moves."""
    model = model_for(args.size_gb, dtype, device, args.vocab, args.hidden)
    save_checkpoint(ModuleSource(model).named_tensors(), scratch / "model", None)
    bench_tokenizer(args.vocab).save_pretrained(scratch / "model")
    model.config.save_pretrained(scratch / "model")
    if args.transport == "lora":
        from peft import LoraConfig, get_peft_model  # imported here: peft takes seconds to import

        config = LoraConfig(r=args.lora_rank, lora_alpha=2 * args.lora_rank, target_modules=args.lora_targets)
        model = get_peft_model(model, config)
    _perturb(model)
    buckets = [
        b.flattened_tensor.view(torch.uint8)
        for b in iter_buckets(_source(args, model).named_tensors(), int(args.bucket_mb * (1 << 20)))
    ]
    return model, buckets


def _source(args, model):
    return LoraSource(model) if args.transport == "lora" else ModuleSource(model, stays=True)


def _perturb(model) -> None:
    """The trainer's "new" weights (lora: the adapter's) differ from what the engine holds."""
    with torch.no_grad():
        for param in model.parameters():
            if param.requires_grad:
                param.add_(torch.randn_like(param) * 1e-3)


async def _verify(url: str, report) -> dict:
    async with EngineClient(url, timeout=600) as client:
        return await find_unverified(report, {0: client})


async def _memory(url: str) -> dict:
    async with EngineClient(url, timeout=600) as client:
        return await client.memory()


async def _tamper(url: str, checkpoint: Path, version: str) -> None:
    async with EngineClient(url, timeout=600) as client:
        await client.update_weights_from_disk(str(checkpoint), weight_version=version)


def _timed_syncs(args, transport, model, url: str, checkpoint: Path) -> tuple[float, list[dict], dict]:
    """One cold send, then `repeats` timed sends each followed by a timed verification."""
    start = time.perf_counter()
    transport.send(_source(args, model), "cold")  # first send: lazy communicator set-up, allocations
    cold = time.perf_counter() - start
    rows, problems = [], {}
    for repeat in range(args.repeats):
        version = str(repeat + 1)
        _perturb(model)  # new weights each step (lora: a new adapter), waited for before the timer
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        settling = time.perf_counter()
        transport.settle()  # what the last sync left running off its path (a run trains meanwhile)
        start = time.perf_counter()
        report = transport.send(_source(args, model), version)
        sent = time.perf_counter()
        if args.tamper_for_test:
            asyncio.run(_tamper(url, checkpoint, version))
        verify_start = time.perf_counter()
        problems = asyncio.run(_verify(url, report))
        verify = time.perf_counter() - verify_start
        rows.append(
            {
                "sync_s": sent - start,
                "verify_s": verify,
                "sync_plus_verify_s": sent - start + verify,
                "left_behind_s": start - settling,
                "verified": not problems,
                "phases": dict(report.phases),
                "resident": report.resident,
            }
        )
        _say("phases (s): " + ", ".join(f"{k} {v:.4f}" for k, v in report.phases.items()) + f" ({report.resident})")
        if problems:
            break
    return cold, rows, problems


def _engine(args, scratch: Path, engine_gpu: int, gpu: bool) -> EngineProcess:
    port = free_port()
    extra = ["--device", args.device, "--base-gpu-id", str(engine_gpu), "--dtype", "bfloat16" if gpu else "float32"]
    if args.transport == "lora":
        extra += LoraTransport.server_args(_lora_spec(args, scratch))
    log_dir = Path(args.log_dir or scratch)
    # forked from a shared zygote where ROLLFLEET_ZYGOTE_SOCKET names one (the test suite's): the sync
    # is measured once the engine is up, so how it started does not change the figures
    return EngineProcess(
        embedded_argv(str(scratch / "model"), port, extra=extra),
        port=port,
        log_path=log_dir / f"engine-{args.transport}.log",
        zygote=Zygote.shared(log_dir / "zygote.log"),
    )


def _lora_spec(args, scratch: Path) -> LoraSync:
    return LoraSync(path=str(scratch / "adapters"), max_lora_rank=args.lora_rank)


def _sync_phase(args, scratch: Path, model, dtype, engine_gpu: int, gpu: bool) -> dict:
    engine = _engine(args, scratch, engine_gpu, gpu)
    try:
        _say("starting the engine")
        engine.wait_until_up(timeout=600)
        spec = {
            "tensor": TensorSync(bucket_mb=args.bucket_mb, resident=not args.packed),
            "nccl": NcclSync(bucket_mb=args.bucket_mb, join_timeout_s=60),
            "disk": DiskSync(path=str(scratch / "sync")),
            "lora": _lora_spec(args, scratch),
        }[args.transport]
        target = EngineTarget(engine_id=0, url=engine.url, num_ranks=1, rank_offset=1, dtype=dtype)
        options = {"config_dir": str(scratch / "model")} if args.transport == "disk" else {}
        transport = make_transport(spec, [target], **options)
        transport.connect()
        gc.collect(), gc.freeze()  # the sender's model out of the collector's scans, as the trainer's actor does
        try:
            _say("sending (cold, then timed)")
            cold, rows, problems = _timed_syncs(args, transport, model, engine.url, scratch / "model")
            memory = asyncio.run(_memory(engine.url))
        finally:
            transport.disconnect()
    finally:
        engine.stop()
    return {"cold_s": cold, "rows": rows, "problems": problems, "engine_memory": memory}


def _summary(args, model_bytes: int, raw: dict, synced: dict, sender_extra: float | None) -> dict:
    rows, gb = synced["rows"], model_bytes / 1e9
    raw_med = statistics.median(raw["timed"])
    sync_med = statistics.median(r["sync_s"] for r in rows)
    full_med = statistics.median(r["sync_plus_verify_s"] for r in rows)
    old_raw = raw["timed"][0] if args.transport in ("tensor", "lora") else raw["first_pass"]
    return {
        "model_gb": gb,
        "raw_path": raw["path"],
        "raw_s": spread(raw["timed"]),
        "raw_gb_per_s": spread([gb / s for s in raw["timed"]]),
        "sync_s": spread([r["sync_s"] for r in rows]),
        "sync_gb_per_s": spread([gb / r["sync_s"] for r in rows]),
        "verify_s": spread([r["verify_s"] for r in rows]),
        "left_behind_s": spread([r["left_behind_s"] for r in rows]),
        "sync_plus_verify_gb_per_s": spread([gb / r["sync_plus_verify_s"] for r in rows]),
        "first_sync_s": synced["cold_s"],
        "ratio_sync_to_raw": raw_med / sync_med,
        "ratio_sync_plus_verify_to_raw": raw_med / full_med,
        "old_method": {
            "what": "this benchmark's ceiling before: one pass (nccl, disk: the first, cold, receiver allocating in "
            "the loop; tensor: one warm pass), divided by the median sync",
            "raw_s": old_raw,
            "ratio_sync_to_raw": old_raw / sync_med,
        },
        "verified": True,
        "phases_s": {
            phase: statistics.median(r["phases"].get(phase, 0.0) for r in rows)
            for phase in dict.fromkeys(p for r in rows for p in r["phases"])
        },
        "sender_peak_extra_gb": sender_extra,
        "engine_memory": synced["engine_memory"],
    }


def _print(args, s: dict) -> None:
    def line(label: str, d: dict, fmt: str = "8.2f") -> str:
        return f"  {label:44} {d['median']:{fmt}}  (min {d['min']:{fmt}}, max {d['max']:{fmt}}, n {d['n']})"

    print(f"weight sync over {args.transport} ({args.device}), {s['model_gb']:.3f} GB in {args.bucket_mb} MB buckets")
    print(line(f"raw ceiling GB/s ({args.transport}, warm)", s["raw_gb_per_s"]))
    print(line("sync GB/s (gather, pack, send, load)", s["sync_gb_per_s"]))
    print(line("sync + fingerprint verification GB/s", s["sync_plus_verify_gb_per_s"]))
    print(line("verification s", s["verify_s"], "8.4f"))
    print(line("last sync's work left running, waited for s", s["left_behind_s"], "8.4f"))
    print(f"  {'first sync of the run (cold) s':44} {s['first_sync_s']:8.4f}")
    print(f"  {'ratio sync / raw (medians)':44} {s['ratio_sync_to_raw']:8.3f}")
    print(f"  {'ratio sync + verification / raw (medians)':44} {s['ratio_sync_plus_verify_to_raw']:8.3f}")
    print(f"  {'old method ratio (single-pass ceiling)':44} {s['old_method']['ratio_sync_to_raw']:8.3f}")
    if s["sender_peak_extra_gb"] is not None:
        print(f"  sender peak extra GPU memory {s['sender_peak_extra_gb']:.2f} GB; engine {s['engine_memory']}")
    print(f"  per phase, ms (median of {s['sync_s']['n']}), beside the raw copy of the same bytes:")
    print(f"    {'raw ceiling (' + args.transport + ')':28} {s['raw_s']['median'] * 1e3:8.2f}")
    print(f"    {'sync':28} {s['sync_s']['median'] * 1e3:8.2f}")
    print(f"    {'verify':28} {s['verify_s']['median'] * 1e3:8.2f}")
    for phase, seconds in s["phases_s"].items():
        print(f"    {'  ' + phase:28} {seconds * 1e3:8.2f}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    command, started = command_line(["rollfleet", "bench", "weight-sync"], argv), start()
    dump_stacks_if_hung()
    gpu = args.device == "cuda"
    sender_device = "cuda:0" if gpu else "cpu"
    engine_gpu = 0 if args.transport in ("tensor", "lora") or torch.cuda.device_count() < 2 else 1
    dtype = torch.bfloat16 if gpu else torch.float32
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        _say("building the model")
        model, buckets = _prepare(args, scratch, dtype, sender_device)
        model_bytes = sum(b.numel() for b in buckets)  # what a sync moves (lora: the adapter)
        _say("measuring the raw ceiling")
        engine_device = f"cuda:{engine_gpu}" if gpu else "cpu"
        raw_path = "tensor" if args.transport == "lora" else args.transport  # lora: a device copy, as tensor
        raw = measure_raw(raw_path, buckets, scratch / "model", args.repeats, gpu, sender_device, engine_device)
        del buckets
        if gpu:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(0)
        sender_before = torch.cuda.memory_allocated(0) if gpu else 0
        synced = _sync_phase(args, scratch, model, dtype, engine_gpu, gpu)
    sender_extra = (torch.cuda.max_memory_allocated(0) - sender_before) / 1e9 if gpu else None
    config = {k: v for k, v in vars(args).items() if k not in ("json", "log_dir")}
    rows = [{"repeat": i + 1, "raw_s": raw["timed"][i], **row} for i, row in enumerate(synced["rows"])]
    if synced["problems"]:
        failure = f"the engine does not hold what was sent: {synced['problems']}"
        summary = {"verified": False, "raw_first_pass_s": raw["first_pass"], "first_sync_s": synced["cold_s"]}
        write_record(
            args.json, make_record("weight-sync", command, config, rows, summary, False, failure, started=started)
        )
        raise SystemExit(f"verification FAILED, no figures reported: {failure}")
    summary = _summary(args, model_bytes, raw, synced, sender_extra)
    summary["raw_first_pass_s"] = raw["first_pass"]
    _print(args, summary)
    write_record(args.json, make_record("weight-sync", command, config, rows, summary, True, started=started))


if __name__ == "__main__":
    main()
