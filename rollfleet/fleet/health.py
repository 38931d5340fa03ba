"""The engine lifecycle: the only way an engine's state changes is `Lifecycle.to(...)`.

    STARTING -> AWAITING_WEIGHTS -> ACTIVE <-> SLEEPING
         \\            |               |
          +------> INACTIVE <--------+      (process died, probe failed, update not verified)
                      |
                      v
                  RECOVERING -> AWAITING_WEIGHTS -> ACTIVE   (restart with dummy weights, restore, verify)

Only ACTIVE engines take generate traffic. AWAITING_WEIGHTS engines are up but hold no verified
weights of the fleet's version; the embedded engine also refuses generate itself until weights
arrive (a dummy start is not ready).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from enum import StrEnum

log = logging.getLogger("rollfleet.health")


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


class IllegalTransition(RuntimeError):
    pass


@dataclass
class Lifecycle:
    engine_id: int
    state: EngineState = EngineState.STARTING
    history: list[tuple[float, str, str, str]] = field(default_factory=list)  # (time, from, to, why)

    def to(self, new: EngineState, reason: str) -> None:
        if new == self.state:
            return
        if new not in ALLOWED[self.state]:
            raise IllegalTransition(
                f"engine {self.engine_id}: {self.state.value} -> {new.value} is not a lifecycle transition ({reason})"
            )
        if new == EngineState.ACTIVE and self.restarted_since_active:
            reason = f"recovered: {reason}"
        self.history.append((time.time(), self.state.value, new.value, reason))
        routine = new in (EngineState.ACTIVE, EngineState.SLEEPING, EngineState.AWAITING_WEIGHTS)
        (log.info if routine else log.warning)(
            "engine %d: %s -> %s (%s)", self.engine_id, self.state.value, new.value, reason
        )
        self.state = new

    @property
    def restarted_since_active(self) -> bool:
        """Whether the engine went through RECOVERING since it was last ACTIVE."""
        for _, _, to, _ in reversed(self.history):
            if to == EngineState.ACTIVE.value:
                return False
            if to == EngineState.RECOVERING.value:
                return True
        return False
