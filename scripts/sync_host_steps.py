"""The sender's side of a weight push, step by step, with no engine: where a push's host milliseconds
go (the source's gathers and renames, fingerprint sampling, packing, serializing), each step timed
alone over the benches' tensors (rollfleet.bench.raw_ceiling.model_for: the Qwen3 shape, 267 tensors
at 24 layers).

    python scripts/sync_host_steps.py                  # a GPU: the 4.16 GB bf16 bench model (and fp32)
    python scripts/sync_host_steps.py --size-gb 0.04 --hidden 256 --vocab 1024   # host costs on a CPU

Prints one line per step: the median wall time (device work waited for) and host time (until the
step's Python returned) of --repeats runs. A same-shaped CPU model of tiny tensors shows the per-tensor
host costs (dispatch, Python), which do not depend on the tensors' size or device.
"""

from __future__ import annotations

import argparse
import time

import torch

from rollfleet.bench.raw_ceiling import model_for
from rollfleet.bench.shapes import REAL_VOCAB
from rollfleet.weights.source import ModuleSource
from rollfleet.weights.transports.base import iter_calls
from rollfleet.weights.transports.staging import DoubleBuffer, PackPlans, call_bytes
from rollfleet.wire.fingerprint import Fingerprints, sample_view
from rollfleet.wire.serialize import serialize


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(label: str, step, device: torch.device, repeats: int) -> None:
    runs = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        step()
        host = time.perf_counter() - start
        _sync(device)
        runs.append((time.perf_counter() - start, host))
    wall, host = sorted(runs)[repeats // 2]
    print(f"{label:44s} wall {wall * 1000:8.2f} ms   host {host * 1000:8.2f} ms", flush=True)


def fingerprinted(tensors, hold: float = 256 << 20) -> Fingerprints:
    collector = Fingerprints(torch.bfloat16, hold_bytes=hold)
    for name, tensor in tensors:
        collector.add(name, tensor)
    return collector


def packed(tensors, bucket_mb: int, cast_to, device: torch.device):
    """A step that packs, waits for and serializes every call of `tensors`, as the tensor transport does."""
    plans, buffers = PackPlans(), DoubleBuffer(bucket_mb << 20)
    calls = list(iter_calls(tensors, bucket_mb << 20, cast_to))

    def step():
        for index, call in enumerate(calls):
            bucket = plans.plan(call, cast_to).pack(call, buffers.take(index, call_bytes(call, cast_to), device))
            _sync(device)
            serialize(bucket.to_payload())

    return len(calls), step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-gb", type=float, default=4.16)
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--vocab", type=int, default=REAL_VOCAB)
    p.add_argument("--bucket-mb", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = model_for(args.size_gb, torch.bfloat16, device.type, args.vocab, args.hidden)
    source = ModuleSource(model)
    tensors = list(source.named_tensors())
    print(f"{len(tensors)} tensors, {sum(t.numel() * t.element_size() for _, t in tensors) / 1e9:.2f} GB on {device}")
    steps = {
        "source (bf16 model, views)": lambda: list(source.named_tensors()),
        "detach + reshape, each tensor": lambda: [t.detach().reshape(-1) for _, t in tensors],
        "sample_view, each tensor": lambda: [sample_view(t) for _, t in tensors],
        "Fingerprints.add, each (flush per 256 MB)": lambda: fingerprinted(tensors),
        "Fingerprints.add, each (no flush)": lambda: fingerprinted(tensors, float("inf")),
        "add + flush": lambda: fingerprinted(tensors, float("inf")).flush(),
        "add + digests": lambda: fingerprinted(tensors).digests(),
    }
    for mb in args.bucket_mb:
        calls, step = packed(tensors, mb, None, device)
        steps[f"pack + wait + serialize, {calls} calls of {mb} MB"] = step
    for label, step in steps.items():
        timed(label, step, device, args.repeats)
    model = model.float()  # a trainer's fp32 master weights, pushed to bf16 engines
    source = ModuleSource(model, dtype=torch.bfloat16)
    timed("fp32 source, cast by the source", lambda: list(source.named_tensors()), device, args.repeats)
    timed("fp32 source, uncast (cast=False)", lambda: list(source.named_tensors(cast=False)), device, args.repeats)
    tensors = list(source.named_tensors(cast=False))
    calls, step = packed(tensors, max(args.bucket_mb), torch.bfloat16, device)
    timed(f"fp32 pack-cast + wait + serialize, {calls} calls", step, device, args.repeats)


if __name__ == "__main__":
    main()
