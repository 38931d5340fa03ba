"""What the Fleet and its colocated turn need of each other and of the trainer, as Protocols in a
module below both, so the helpers of fleet/ never import fleet.py (imports in fleet/ run one way:
fleet.py on top). Recovery, the restore sources and the peer restore take the parts they use (the
slots, the pool, the config, `WeightSends`) in their constructors instead."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Protocol

from rollfleet.config import RolloutConfig
from rollfleet.weights.transports import EngineTarget, SyncReport
from rollfleet.wire.pool import EnginePool


class Trainers(Protocol):
    """What the fleet needs of a trainer (rollfleet.train.worker.TrainerGroup is one)."""

    def push_weights(self, spec, targets: list[EngineTarget], version: str, **options) -> SyncReport: ...
    def onload(self) -> dict | None: ...  # bytes moved and seconds
    def offload(self) -> dict | None: ...


class RestartPause(Protocol):
    def paused(self, starts: bool = True) -> AbstractContextManager: ...


class TurnFleet(Protocol):
    """What the colocated trainer's turn (rollfleet.fleet.colocation) needs of the fleet
    (rollfleet.fleet.fleet.Fleet is one)."""

    rollout: RolloutConfig
    pool: EnginePool
    recovery: RestartPause  # no restart begins while the trainer holds the GPUs

    def running(self, engine_ids: list[int] | None = None) -> list[int]: ...
    def sleep(self, tags: list[str] | None = None) -> list[dict]: ...
    def wake(self, tags: list[str] | None = None) -> None: ...
