"""One weight push of a run under torch.profiler, to see where a sync's milliseconds go on a GPU: the
per-phase split (SyncReport's `phases`) says which phase is slow, the profile says why (kernels,
copies, synchronizations, host time between them).

    ROLLFLEET_SYNC_PROFILE=DIR [ROLLFLEET_SYNC_PROFILE_PUSH=3] rollfleet train ...

Each trainer rank writes `DIR/sync-profile-rank{R}-push{N}.txt` for its N-th push (default the third:
past the first push's set-up of buffers, groups and sessions): the push's wall time and two tables of
its ops, by device time and by host time. Unset, a push is not touched. The engines' side of each
load is ROLLFLEET_SYNC_TIMING=1 (their logs).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch
from torch.profiler import ProfilerActivity, profile

log = logging.getLogger("rollfleet.train")
DIR_ENV, PUSH_ENV = "ROLLFLEET_SYNC_PROFILE", "ROLLFLEET_SYNC_PROFILE_PUSH"
ROWS = 30
T = TypeVar("T")


class SyncProfiler:
    """Counts a rank's pushes and profiles the chosen one (none when DIR_ENV is unset)."""

    def __init__(self, rank: int):
        self.rank, self.pushes = rank, 0
        self.dir = os.environ.get(DIR_ENV) or None
        self.at = int(os.environ.get(PUSH_ENV, "3"))

    def around(self, send: Callable[[], T]) -> T:
        """`send()`, profiled when it is the chosen push."""
        self.pushes += 1
        if self.dir is None or self.pushes != self.at:
            return send()
        cuda = torch.cuda.is_available()
        activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
        start = time.perf_counter()
        with profile(activities=activities) as prof:
            result = send()
            if cuda:
                torch.cuda.synchronize()
        wall = time.perf_counter() - start
        path = Path(self.dir) / f"sync-profile-rank{self.rank}-push{self.pushes}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        averages = prof.key_averages()
        tables = [f"push {self.pushes} of rank {self.rank}: {wall * 1000:.1f} ms wall, under the profiler\n"]
        if cuda:
            tables += ["by device time", averages.table(sort_by="self_cuda_time_total", row_limit=ROWS)]
        tables += ["by host time", averages.table(sort_by="self_cpu_time_total", row_limit=ROWS)]
        path.write_text("\n".join(tables) + "\n")
        log.warning("sync profile of push %d written to %s", self.pushes, path)
        return result
