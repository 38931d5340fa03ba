"""How torch_memory_saver's pause and resume times depend on how a paused tag's memory is split, on one GPU:

    python scripts/gpu_bench_saver_regions.py [--gib 60] [--splits 1,4,16,48,192] [--repeats 3]

The engine's KV pool is one allocation per layer's keys and values (48 for the benches' 24 layers); one
allocation for all of it (6cb1da6, reverted) resumed more slowly on H100s: 184-188 ms in the saver check
(65 GiB) against 91-113 ms with 48, and 83-127 ms in the loop against 47-79. This times the saver
alone: --gib of bf16 memory allocated inside a region as N equal tensors, paused and resumed --repeats
times, each split in a fresh process (a paused tag's pages must not be reused by the next).
Prints one JSON line per split (also appended to $OUT/saver-regions.json when OUT is set).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

KEPT: list = []


def one_split(gib: float, split: int, repeats: int) -> dict:
    import torch
    from torch_memory_saver import torch_memory_saver as saver

    saver.hook_mode = "torch"
    device = torch.device("cuda")
    elements = int(gib * 2**30 / 2 / split)
    with saver.region(tag="kv_cache"):
        tensors = [torch.zeros(elements, dtype=torch.bfloat16, device=device) for _ in range(split)]
    torch.cuda.synchronize()
    pauses, resumes = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        saver.pause("kv_cache")
        pauses.append(time.perf_counter() - start)
        start = time.perf_counter()
        saver.resume("kv_cache")
        resumes.append(time.perf_counter() - start)
        tensors[0].fill_(1)  # the memory is usable again
        torch.cuda.synchronize()
    KEPT.extend(tensors)  # freed only by the process's end (main)
    return {
        "gib": gib,
        "split": split,
        "pause_ms": [round(1000 * s, 2) for s in pauses],
        "resume_ms": [round(1000 * s, 2) for s in resumes],
        "pause_median_ms": round(1000 * statistics.median(pauses), 2),
        "resume_median_ms": round(1000 * statistics.median(resumes), 2),
        "gpu": torch.cuda.get_device_name(device),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=60.0)
    parser.add_argument("--splits", default="1,4,16,48,192")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # the child's split
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(one_split(args.gib, args.one, args.repeats)), flush=True)
        # no teardown: the saver's free of its tensors outside their region ended the first run of this
        # script with "only support interesting region" (tms_torch_free), before anything was printed
        os._exit(0)
    out = os.environ.get("OUT")
    for split in (int(s) for s in args.splits.split(",")):
        argv = [sys.executable, __file__, "--gib", str(args.gib), "--repeats", str(args.repeats), "--one", str(split)]
        done = subprocess.run(argv, capture_output=True, text=True)
        line = (
            done.stdout.strip().splitlines()[-1]
            if done.returncode == 0
            else json.dumps({"split": split, "failed": done.returncode, "stderr": done.stderr[-800:]})
        )
        print(line, flush=True)
        if out:
            with open(os.path.join(out, "saver-regions.json"), "a") as f:
                f.write(line + "\n")


if __name__ == "__main__":
    main()
