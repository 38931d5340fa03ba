"""Prompt GIL handoffs while a thread works beside the engine pool's loop thread (a weight push).

A push's main thread gathers and packs call k+1 while the pool's loop thread (rollfleet.wire.pool)
sends call k and reads the answer of call k-1. Both need the GIL; CPython lets a thread that wants
it wait for the holder's switch interval (5 ms by default) unless the holder blocks first. A push's
Python work between blocking points is about a millisecond or two per call, so with the default
the loop thread sent call k only once the main thread blocked on the engines: the engine's load and
the next call's packing ran one after the other instead of side by side. A shorter interval while a
push runs lets each thread in within a fraction of a millisecond (an engine process sets 1 ms for its
whole life: rollfleet.engine.process.rank_zero).

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
