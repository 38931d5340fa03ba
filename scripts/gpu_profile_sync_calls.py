"""Where a same-GPU push's fixed costs go, on the GPU, with no HTTP: the sender's fingerprints of
every tensor once sampled (`Fingerprints.digests()`: the cat, the hash on the device, the sums to
the host; until 432a53d the launch of a host hash on a thread, `hash_gathered(wait=False)`, which
the log of 6b47c7b shows) and an engine's decode of one call (unpickling a bucket's CUDA IPC
handle, unpacking, the copy into its parameters), each under cProfile, so the next change aims at
a measured cost.

    python scripts/gpu_profile_sync_calls.py [--size-gb 4.16] [--bucket-mb 512] [--repeats 5]

The receiver is a spawned process (an engine's own), fed the serialized calls through a pipe. It
decodes every call of a push twice per repeat: dropping each call's tensors after its copy (what an
engine does today) and keeping the last two calls' storages alive (what a receiver cache of the
sender's two reusable buffers would do), so the IPC open's share is the difference.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch
import torch.multiprocessing as mp

from rollfleet.bench.raw_ceiling import model_for
from rollfleet.engine.tp.payloads import decode_entry, named_tensors
from rollfleet.weights.source import ModuleSource
from rollfleet.weights.transports.base import iter_calls
from rollfleet.weights.transports.staging import DoubleBuffer, PackPlans, call_bytes
from rollfleet.wire.fingerprint import Fingerprints
from rollfleet.wire.serialize import serialize


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _device() -> torch.device:
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def top(profile: cProfile.Profile, lines: int = 14) -> str:
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(lines)
    return "\n".join(line for line in text.getvalue().splitlines() if line.strip())[-3000:]


def sender_fingerprints(tensors, repeats: int) -> None:
    profile, seconds = cProfile.Profile(), []
    for _ in range(repeats):
        _sync()
        collector = Fingerprints(torch.bfloat16)
        for name, tensor in tensors:
            collector.add(name, tensor)
        start = time.perf_counter()
        profile.enable()
        collector.digests()
        profile.disable()
        seconds.append(time.perf_counter() - start)
    median = sorted(seconds)[repeats // 2] * 1e3
    print(f"digests() of {len(tensors)} sampled tensors: {median:.2f} ms (median of {repeats})")
    print(top(profile))


def receiver(pipe, keep_alive: bool) -> None:
    if torch.cuda.is_available():
        torch.cuda.set_device(0)
    targets: dict[str, torch.Tensor] = {}
    kept: list = []
    profile = cProfile.Profile()
    while True:
        message = pipe.recv()
        if message is None:
            break
        times = []
        for entry in message:
            start = time.perf_counter()
            profile.enable()
            payload = decode_entry([entry], 0)
            decoded = time.perf_counter()
            tensors = named_tensors(payload, "flattened_bucket", 0)
            unpacked = time.perf_counter()
            for name, tensor in tensors.items():
                if name not in targets:
                    targets[name] = torch.empty_like(tensor)
            torch._foreach_copy_([targets[n] for n in tensors], list(tensors.values()))
            _sync()
            profile.disable()
            copied = time.perf_counter()
            times.append((decoded - start, unpacked - decoded, copied - unpacked))
            if keep_alive:
                kept = [*kept[-1:], payload]
            del payload, tensors
        pipe.send(times)
    pipe.send(top(profile))


def receiver_side(calls, bucket_bytes: int, repeats: int) -> None:
    plans, buffers, device = PackPlans(), DoubleBuffer(bucket_bytes), _device()
    context = mp.get_context("spawn")
    for keep_alive in (False, True):
        ours, theirs = context.Pipe()
        child = context.Process(target=receiver, args=(theirs, keep_alive))
        child.start()
        per_call = []
        for _ in range(repeats + 1):  # the first push opens everything for the first time
            entries, kept = [], []
            for index, call in enumerate(calls):
                bucket = plans.plan(call, None).pack(call, buffers.take(index, call_bytes(call, None), device))
                _sync()
                kept.append(bucket)
                entries.append(serialize(bucket.to_payload()))
            ours.send(entries)
            per_call.append(ours.recv())
        ours.send(None)
        profile = ours.recv()
        child.join()
        rows = [row for push in per_call[1:] for row in push]
        medians = [sorted(r[i] for r in rows)[len(rows) // 2] * 1e3 for i in range(3)]
        print(
            f"receiver, {'keeping the last two calls alive' if keep_alive else 'dropping each call'}: "
            f"per call (median of {len(rows)}) unpickle {medians[0]:.3f} ms, unpack {medians[1]:.3f} ms, "
            f"copy + sync {medians[2]:.3f} ms; first push's calls: "
            + ", ".join(f"{sum(r) * 1e3:.2f}" for r in per_call[0])
        )
        print(profile)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-gb", type=float, default=4.16)
    p.add_argument("--bucket-mb", type=int, default=512)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--hidden", type=int, default=None, help="a CPU try: --size-gb 0.05 --hidden 256")
    args = p.parse_args()
    model = model_for(args.size_gb, torch.bfloat16, _device().type, hidden=args.hidden)
    tensors = list(ModuleSource(model).named_tensors())
    sender_fingerprints(tensors, args.repeats)
    calls = list(iter_calls(tensors, args.bucket_mb << 20, None))
    print(f"{len(tensors)} tensors in {len(calls)} calls of <= {args.bucket_mb} MB")
    receiver_side(calls, args.bucket_mb << 20, args.repeats)


if __name__ == "__main__":
    main()
