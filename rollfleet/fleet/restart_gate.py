"""Which recovery work may run beside a push, and which waits (Recovery holds one `RestartGate`).

One restart or restore runs at a time, in one of two phases:
- "starting": engine processes start with no weights to pull (dummy or static loads). A push may
  run meanwhile: it goes to the engines that serve, and an engine that comes up during it is
  restored afterwards at the version it verified. A colocated trainer's turn may not: a start
  allocates GPU memory the trainer holds.
- "restoring": weights are loaded into waiting engines (a restore, or an SGLang start that pulls
  from a seed). Exclusive with pushes: a push never overlaps a restore.

`paused(starts=...)` is what a push (`starts=False`) or a trainer's turn (`starts=True`) holds: it
waits for the phase it excludes, and while it is held no background restart begins (a turn) and no
background restore begins (either). A background restart never waits for a pause to end, so no
pause holder that waits for the restart can deadlock with it: it skips the restore instead, and the
restarter is woken when the last pause ends (`on_resume`). Every wait and change is under the
caller's lock (Recovery's one condition).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import contextmanager


class RestartGate:
    def __init__(self, lock: threading.Condition, on_resume: Callable[[], None]):
        self._lock, self._on_resume = lock, on_resume
        self.phase: str | None = None  # None, "starting" or "restoring"
        self._pauses = 0  # pushes and trainer turns under way
        self._start_pauses = 0  # trainer turns under way (no engine may start)
        self._skipped = False  # a background restore was skipped for a pause: wake the restarter after

    @contextmanager
    def paused(self, starts: bool = True):
        """No restore overlaps this block, and (with `starts`) no engine start either."""
        with self._lock:
            self._pauses += 1
            self._start_pauses += starts
            self._lock.wait_for(lambda: self.phase is None or (not starts and self.phase == "starting"))
        try:
            yield
        finally:
            with self._lock:
                self._pauses -= 1
                self._start_pauses -= starts
                resume = self._skipped and not self._pauses
                if resume:
                    self._skipped = False
            if resume:
                self._on_resume()

    def wait_idle(self) -> None:
        """(Under the lock) until no restart or restore is under way."""
        self._lock.wait_for(lambda: self.phase is None)

    def may_begin(self, background: bool, pulls_at_start: bool) -> bool:
        """(Under the lock) whether a restart may begin now: a background one not while a pause
        forbids its first phase; a caller's own always (the caller knows what it holds)."""
        return not (background and (self._pauses if pulls_at_start else self._start_pauses))

    def begin(self, restoring: bool) -> None:
        """(Under the lock, once idle) take the gate: for a restore, or a start that pulls weights
        (`restoring`), else for a start."""
        self.phase = "restoring" if restoring else "starting"

    def restoring(self, background: bool) -> bool:
        """Enter the restoring phase; False (the restore is skipped) when a background restart
        meets a pause: it never waits for one. A caller's own restart goes on (the caller knows
        what it holds)."""
        with self._lock:
            if self.phase == "restoring":
                return True
            if background and self._pauses:
                self._skipped = True
                return False
            self.phase = "restoring"
            return True

    def starting(self, pulls_at_start: bool) -> None:
        """Back to the starting phase after a restore, unless the starts pull weights; only ever
        loosens the gate, so the pushes it lets through need no check."""
        with self._lock:
            if not pulls_at_start:
                self.phase = "starting"
                self._lock.notify_all()

    def end(self) -> None:
        """(Under the lock) release the gate."""
        self.phase = None
        self._lock.notify_all()
