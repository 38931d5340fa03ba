"""How long the engine pool's loop thread takes to start a call that a busy thread submitted, with
the process's default GIL switch interval and inside `prompt_handoffs()` (rollfleet.wire.handoffs).

A weight push's main thread submits call k to the pool and goes on packing call k+1 (Python work,
about `--busy-ms` a call); the loop thread starts sending call k only when it gets the GIL.

    python scripts/handoff_latency.py [--busy-ms 2] [--calls 50]

On this project's 2-core CPU (2026-12-06, busy 2 ms): 2.15 ms with the default 5 ms interval (the
loop thread waits until the main thread blocks), 0.45 ms with 0.2 ms."""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time

from rollfleet.wire.handoffs import prompt_handoffs
from rollfleet.wire.pool import EnginePool


async def _started() -> float:
    return time.perf_counter()


def _busy(seconds: float) -> int:
    end, count = time.perf_counter() + seconds, 0
    while time.perf_counter() < end:
        count += 1
    return count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--busy-ms", type=float, default=2.0)
    parser.add_argument("--calls", type=int, default=50)
    args = parser.parse_args()
    pool = EnginePool()
    try:
        for label, block in [("default", contextlib.nullcontext), ("prompt_handoffs", prompt_handoffs)]:
            delays = []
            with block():
                interval = sys.getswitchinterval()
                for _ in range(args.calls):
                    submitted = time.perf_counter()
                    future = pool.submit(_started())
                    _busy(args.busy_ms / 1e3)
                    delays.append((future.result() - submitted) * 1e3)
            print(
                f"{label:16s} switch interval {interval * 1e3:.1f} ms: the loop thread starts a call "
                f"{statistics.median(delays):.2f} ms after it was submitted (median of {args.calls}; "
                f"the submitter busy {args.busy_ms} ms)"
            )
    finally:
        pool.close()


if __name__ == "__main__":
    main()
