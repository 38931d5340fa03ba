"""Prompt GIL handoffs while a thread works beside the engine pool's loop thread (a weight push).

A push's main thread gathers and packs the next call while the pool's loop thread (rollfleet.wire.pool)
sends a call and reads answers; a LoRA push's adapter directory is written by a third thread
meanwhile. Each needs the GIL, and CPython lets a thread that wants it wait for the holder's switch
interval (5 ms by default) unless the holder blocks first: scripts/handoff_latency.py shows a call
submitted beside 2 ms of Python started 2.2 ms later, 0.45 ms with a 0.2 ms interval. Measured on
an H100 (docs/results/checks/main-job-1xh100/sync-ab-views-handoffs-c081da9.log): a LoRA push's two
version round trips, run while its directory is written, 4.7 -> 1.7 ms; a tensor push with one call
in flight, no gain (29.3 / 28.7 ms at 5 ms, 30.1 / 30.4 at 0.2 ms: perhaps a millisecond worse),
and 15f6f5d's two calls in flight were measured with it on only. An engine process sets 1 ms for its whole life
(rollfleet.engine.process.rank_zero).

The interval is the process's: it is set while at least one `prompt_handoffs()` block runs (pushes
may overlap in a process with several fleets) and put back when the last one ends.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

PUSH_SWITCH_INTERVAL_S = 0.0002


class _Interval:
    def __init__(self):
        self.lock, self.depth, self.saved = threading.Lock(), 0, 0.0

    def enter(self, seconds: float) -> None:
        with self.lock:
            if self.depth == 0:
                self.saved = sys.getswitchinterval()
                sys.setswitchinterval(min(seconds, self.saved))
            self.depth += 1

    def leave(self) -> None:
        with self.lock:
            self.depth -= 1
            if self.depth == 0:
                sys.setswitchinterval(self.saved)


_INTERVAL = _Interval()


@contextmanager
def prompt_handoffs(seconds: float | None = None) -> Iterator[None]:
    """Run the block with the GIL's switch interval at most `seconds` (default
    PUSH_SWITCH_INTERVAL_S; module docstring)."""
    _INTERVAL.enter(PUSH_SWITCH_INTERVAL_S if seconds is None else seconds)
    try:
        yield
    finally:
        _INTERVAL.leave()
