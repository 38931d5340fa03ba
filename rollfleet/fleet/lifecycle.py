"""The engine lifecycle: the only way an engine's state changes is `Lifecycle.to(...)`.

    STARTING -> AWAITING_WEIGHTS -> ACTIVE <-> SLEEPING
         \\            |               |
          +------> INACTIVE <--------+      (process died, probe failed, update not verified)
                      |
                      v
                  RECOVERING -> AWAITING_WEIGHTS -> ACTIVE   (restart with dummy weights, restore, verify)

ACTIVE or SLEEPING -> AWAITING_WEIGHTS: its weights were released, a push to it failed part-way, or
an explicit restore replaces them. AWAITING_WEIGHTS -> ACTIVE only once its weights are verified (a
push, or a restore); AWAITING_WEIGHTS -> INACTIVE when it dies or hangs (probes cover it too).
Only ACTIVE engines take generate traffic. AWAITING_WEIGHTS engines are up but hold no verified
weights of the fleet's version; the embedded engine also refuses generate itself until weights
arrive (a dummy start is not ready). `EngineSlot` is the fleet's record of one engine: where it
answers, which version it holds (verified), and its lifecycle.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

log = logging.getLogger("rollfleet.lifecycle")


class EngineState(StrEnum):
    STARTING = "STARTING"
    AWAITING_WEIGHTS = "AWAITING_WEIGHTS"
    ACTIVE = "ACTIVE"
    SLEEPING = "SLEEPING"
    INACTIVE = "INACTIVE"
    RECOVERING = "RECOVERING"


S = EngineState
ALLOWED: dict[EngineState, set[EngineState]] = {
    S.STARTING: {S.AWAITING_WEIGHTS, S.ACTIVE, S.INACTIVE},
    S.AWAITING_WEIGHTS: {S.ACTIVE, S.INACTIVE},
    S.ACTIVE: {S.SLEEPING, S.INACTIVE, S.AWAITING_WEIGHTS},
    S.SLEEPING: {S.ACTIVE, S.AWAITING_WEIGHTS, S.INACTIVE},
    S.INACTIVE: {S.RECOVERING},
    S.RECOVERING: {S.AWAITING_WEIGHTS, S.INACTIVE},
}


FAILED = (EngineState.INACTIVE, EngineState.RECOVERING)


def backoff_s(tries: int, base_s: float, max_s: float) -> float:
    """The wait before restart try `tries + 1`: none before the first, then `base_s` doubling per try."""
    return 0.0 if tries < 1 or base_s <= 0 else min(base_s * 2 ** (tries - 1), max_s)


class IllegalTransition(RuntimeError):
    pass


@dataclass(frozen=True)
class Transition:
    time: float
    old: EngineState
    new: EngineState
    why: str


@dataclass
class Lifecycle:
    engine_id: int
    state: EngineState = EngineState.STARTING
    history: list[Transition] = field(default_factory=list)

    def to(self, new: EngineState, reason: str) -> None:
        if new == self.state:
            return
        if new not in ALLOWED[self.state]:
            raise IllegalTransition(
                f"engine {self.engine_id}: {self.state.value} -> {new.value} is not a lifecycle transition ({reason})"
            )
        if new == EngineState.ACTIVE and self.restarted_since_active:
            reason = f"recovered: {reason}"
        self.history.append(Transition(time.time(), self.state, new, reason))
        routine = new in (EngineState.ACTIVE, EngineState.SLEEPING, EngineState.AWAITING_WEIGHTS)
        (log.info if routine else log.warning)(
            "engine %d: %s -> %s (%s)", self.engine_id, self.state.value, new.value, reason
        )
        self.state = new

    @property
    def restarted_since_active(self) -> bool:
        """Whether the engine went through RECOVERING since it was last ACTIVE."""
        for transition in reversed(self.history):
            if transition.new == EngineState.ACTIVE:
                return False
            if transition.new == EngineState.RECOVERING:
                return True
        return False

    def restarts_since_active(self) -> tuple[int, float]:
        """Restarts tried since the engine last served (each an entry into RECOVERING), and when it
        last went INACTIVE (0.0 if never): the restart backoff's inputs."""
        tries, last_down = 0, 0.0
        for transition in reversed(self.history):
            if transition.new == EngineState.ACTIVE:
                break
            if transition.new == EngineState.RECOVERING:
                tries += 1
            elif transition.new == EngineState.INACTIVE and not last_down:
                last_down = transition.time
        return tries, last_down

    def restart_wait_s(self, base_s: float, max_s: float) -> float:
        """Seconds before the next restart try: none for the first try after the engine served, then
        `base_s` doubling with each try that did not bring it back (`backoff_s`), from its last INACTIVE."""
        tries, last_down = self.restarts_since_active()
        wait = backoff_s(tries, base_s, max_s)
        return max(0.0, last_down + wait - time.time()) if wait else 0.0

    def mark(self) -> int:
        """A point in the history, for `since` and `failed_since`."""
        return len(self.history)

    def since(self, mark: int) -> list[Transition]:
        return self.history[mark:]

    def failed_since(self, mark: int) -> bool:
        """Whether the engine went INACTIVE (or on to RECOVERING) since `mark`."""
        return any(t.new in FAILED for t in self.since(mark))


RUNNING = (EngineState.ACTIVE, EngineState.SLEEPING, EngineState.AWAITING_WEIGHTS)


@dataclass
class EngineSlot:
    """The fleet's view of one engine."""

    engine_id: int
    url: str
    head: Any  # the RolloutWorker actor that owns the engine process
    gpu_ids: list[str] = field(default_factory=list)
    version: str = "default"  # the weight version last verified on it ("" when it holds none)
    dtype: str | None = None  # parameter dtype as the engine reports it (asked once)
    outstanding: int = 0  # generate requests in flight
    standby: bool = False  # a warm standby: up, no weights, no traffic, no pushes (rollfleet.fleet.standby)
    lifecycle: Lifecycle = None  # set in __post_init__

    def __post_init__(self):
        if self.lifecycle is None:
            self.lifecycle = Lifecycle(self.engine_id)

    @property
    def state(self) -> EngineState:
        return self.lifecycle.state

    @property
    def is_running(self) -> bool:
        """The process is up and reachable (it may not serve generate)."""
        return self.state in RUNNING
