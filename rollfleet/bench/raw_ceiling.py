"""The raw ceilings the weight-sync benchmark divides by, and the model it sends.

Each ceiling is measured warm and repeated: one untimed pass first (connections, communicators,
allocator), buffers allocated before the clock starts, then `repeats` timed passes; the caller
reports their spread and median. The first pass is kept too, as `first_pass` (nccl: a cold pass
whose receiver allocates every bucket inside the timed loop, i.e. how this benchmark measured the
ceiling before; a ceiling measured that way is slower, so it biased sync / raw upward).
"""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import AutoModelForCausalLM

from rollfleet.bench.shapes import REAL_VOCAB, qwen3_shape
from rollfleet.tiny_models import tiny_config
from rollfleet.wire.group import join_weight_update_group
from rollfleet.wire.hf_files import iter_checkpoint
from rollfleet.wire.net import free_port

RAW_PATHS = {
    "nccl": "plain broadcasts of the same buckets to a bare receiver (its buffers allocated before timing)",
    "tensor": "device copy of the same bytes into buffers allocated before timing",
    "disk": "reading the saved checkpoint files onto the engine's device",
}


def model_for(size_gb: float, dtype: torch.dtype, device: str, vocab: int = REAL_VOCAB, hidden: int | None = None):
    """A model of the benchmarks' shape (rollfleet.bench.shapes) of about size_gb with its embedding and
    lm_head of `vocab` entries, built directly on `device`; `hidden` chosen by size unless given."""
    bytes_per = torch.finfo(dtype).bits // 8
    if hidden is None:  # 8B-class models have hidden 4096
        hidden = 4096 if size_gb >= 12 else 2048 if size_gb >= 1 else 256
    per_layer = 12 * hidden * hidden * bytes_per  # attention 4h^2 (GQA ~3h^2) + MLP 3*h*4h
    embeddings = 2 * vocab * hidden * bytes_per  # embed_tokens and an untied lm_head
    layers = max(1, round((size_gb * 1e9 - embeddings) / per_layer))
    config = tiny_config("qwen3", vocab_size=vocab, **qwen3_shape(hidden, layers))
    torch.manual_seed(0)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _raw_receiver(port: int, sizes: list[int], repeats: int, device: str, backend: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    group = join_weight_update_group("127.0.0.1", port, 1, 2, "raw", backend, timedelta(seconds=60))
    line = torch.zeros(1, device=device)
    dist.broadcast(torch.empty(1, device=device), group=group, group_src=0)  # connections, communicator
    dist.all_reduce(line, group=group)
    for size in sizes:  # the first pass: cold, allocating inside the loop (the old measurement)
        dist.broadcast(torch.empty(size, dtype=torch.uint8, device=device), group=group, group_src=0)
    dist.all_reduce(line, group=group)
    buffers = [torch.empty(max(sizes), dtype=torch.uint8, device=device) for _ in range(min(2, len(sizes)))]
    for _ in range(1 + repeats):  # one untimed warm pass, then the timed ones
        dist.all_reduce(line, group=group)  # the start line
        for i, size in enumerate(sizes):
            dist.broadcast(buffers[i % len(buffers)][:size], group=group, group_src=0)
        dist.all_reduce(line, group=group)  # "all received", for the sender's clock
    _sync(device)
    dist.destroy_process_group(group)  # exiting with a live gloo group can abort the process


def _broadcast_pass(buckets: list[torch.Tensor], group, device: str) -> float:
    line = torch.zeros(1, device=device)
    dist.all_reduce(line, group=group)
    _sync(device)
    start = time.perf_counter()
    for bucket in buckets:
        dist.broadcast(bucket, group=group, group_src=0)
    dist.all_reduce(line, group=group)
    _sync(device)
    return time.perf_counter() - start


def raw_broadcast(buckets: list[torch.Tensor], repeats: int, device: str, receiver_device: str, backend: str) -> dict:
    port = free_port()
    sizes = [b.numel() for b in buckets]
    proc = mp.get_context("spawn").Process(target=_raw_receiver, args=(port, sizes, repeats, receiver_device, backend))
    proc.start()
    group = join_weight_update_group("127.0.0.1", port, 0, 2, "raw", backend, timedelta(seconds=60))
    try:
        dist.broadcast(torch.zeros(1, device=device), group=group, group_src=0)
        first = _broadcast_pass(buckets, group, device)
        _broadcast_pass(buckets, group, device)  # warm-up, untimed
        timed = [_broadcast_pass(buckets, group, device) for _ in range(repeats)]
    finally:
        dist.destroy_process_group(group)  # first: NCCL's teardown on the receiver waits for this side
        proc.join(timeout=120)
        if proc.is_alive():
            proc.kill()
            proc.join()
    if proc.exitcode != 0:
        raise RuntimeError(f"the raw receiver exited with {proc.exitcode}")
    return {"first_pass": first, "timed": timed}


def _copy_pass(buckets: list[torch.Tensor], targets: list[torch.Tensor]) -> float:
    _sync(str(buckets[0].device))
    start = time.perf_counter()
    for i, bucket in enumerate(buckets):
        targets[i % len(targets)][: bucket.numel()].copy_(bucket)
    _sync(str(buckets[0].device))
    return time.perf_counter() - start


def raw_copy(buckets: list[torch.Tensor], repeats: int) -> dict:
    largest = max(b.numel() for b in buckets)
    targets = [torch.empty(largest, dtype=torch.uint8, device=buckets[0].device) for _ in range(min(2, len(buckets)))]
    first = _copy_pass(buckets, targets)  # also the warm-up
    return {"first_pass": first, "timed": [_copy_pass(buckets, targets) for _ in range(repeats)]}


def _read_pass(directory: Path, device: str) -> float:
    start = time.perf_counter()
    for _ in iter_checkpoint(directory, device):  # the engine's own reader, one file at a time
        pass
    _sync(device)
    return time.perf_counter() - start


def raw_read(directory: Path, repeats: int, device: str) -> dict:
    """Reading allocates by nature; the files are in the page cache after the first pass."""
    first = _read_pass(directory, device)
    return {"first_pass": first, "timed": [_read_pass(directory, device) for _ in range(repeats)]}


def measure_raw(transport: str, buckets, checkpoint: Path, repeats: int, gpu: bool, sender: str, engine: str) -> dict:
    """{"first_pass": seconds, "timed": [seconds] * repeats, "path": what was measured}."""
    if transport == "nccl":
        figures = raw_broadcast(buckets, repeats, sender, engine, "nccl" if gpu else "gloo")
    elif transport == "tensor":
        figures = raw_copy(buckets, repeats)
    else:
        figures = raw_read(checkpoint, repeats, engine)
    return {**figures, "path": RAW_PATHS[transport]}
