"""Where an engine's start goes: wall-clock phases from the launcher's spawn to a listening server.

The launcher stamps the time it spawns the process (`SPAWNED_AT_ENV`, `spawn_env`); importing this
module stamps the engine's first line (the server imports it before anything heavy). From there the
server marks the end of each phase in order (`StartTimer.mark`); a phase is the time since the
previous mark, so the phases add up to the total and none overlaps another. Rank 0 also carries each
tp follower's own phases (they run beside rank 0's, not after them).

Wall-clock (`time.time`) rather than a monotonic clock: the spawn stamp crosses a process boundary.
"""

from __future__ import annotations

import os
import time

FIRST_LINE_AT = time.time()  # when this process first imported this module: the engine's first line
SPAWNED_AT_ENV = "ROLLFLEET_SPAWNED_AT"
FORKED_AT_ENV = "ROLLFLEET_FORKED_AT"  # set by the zygote (zygote.py) in a child it forked: the fork's time


def spawn_env(env: dict[str, str] | None) -> dict[str, str]:
    """`env` (this process's environment when None) with the spawn time stamped, just before a spawn."""
    return {**(os.environ if env is None else env), SPAWNED_AT_ENV: repr(time.time())}


class StartTimer:
    """Phases of one process's start; `breakdown()` is what the engine logs and reports."""

    def __init__(self, spawned_at: float | None = None, first_line_at: float = FIRST_LINE_AT, launch: str = "spawn"):
        self.launch = launch  # "spawn" (a new interpreter) or "zygote" (forked, imports done before)
        self.started_at = first_line_at if spawned_at is None else spawned_at
        self.phases: dict[str, float] = {}
        self._last = first_line_at
        if spawned_at is not None:
            self.phases["spawn"] = max(0.0, first_line_at - spawned_at)  # fork, exec, interpreter start
        self.followers: list[dict[str, float]] = []

    @classmethod
    def from_env(cls) -> StartTimer:
        """The launcher's stamps (popped: tp followers inherit the environment). A forked start's
        first line is the fork: this module was imported by the zygote long before."""
        spawned_at, forked_at = _stamp(SPAWNED_AT_ENV), _stamp(FORKED_AT_ENV)
        if forked_at is not None:
            return cls(spawned_at, first_line_at=forked_at, launch="zygote")
        return cls(spawned_at)

    def mark(self, phase: str) -> float:
        """End `phase` now; its seconds (a phase marked twice adds up)."""
        now = time.time()
        seconds = max(0.0, now - self._last)
        self.phases[phase] = self.phases.get(phase, 0.0) + seconds
        self._last = now
        return seconds

    @property
    def total(self) -> float:
        return max(0.0, self._last - self.started_at)

    def breakdown(self) -> dict:
        """{"total_s", "launch", "phases": {name: s} in start order, "followers": [{name: s}] per tp rank > 0}."""
        return {
            "total_s": round(self.total, 4),
            "launch": self.launch,
            "phases": {name: round(seconds, 4) for name, seconds in self.phases.items()},
            "followers": [{name: round(s, 4) for name, s in phases.items()} for phases in self.followers],
        }

    def line(self) -> str:
        """The one log line: `engine start 7.91s: spawn 0.04, imports 3.10, ...`."""
        parts = ", ".join(f"{name} {seconds:.2f}" for name, seconds in self.phases.items())
        line = f"engine start {self.total:.2f}s ({self.launch}): {parts}"
        for rank, phases in enumerate(self.followers, start=1):
            line += f"; rank {rank}: " + ", ".join(f"{name} {s:.2f}" for name, s in phases.items())
        return line


def _stamp(name: str) -> float | None:
    try:
        return float(os.environ.pop(name, ""))
    except ValueError:  # unset or garbled: no stamp
        return None
