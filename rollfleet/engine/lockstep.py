"""Lockstep execution across the tp ranks of one engine.

Rank 0 decides: `Lockstep(Action.X, **kwargs)` broadcasts the action and its arguments on the
gloo control group, then runs it on rank 0's `ModelRunner` and returns rank 0's result. Every
follower rank runs the same actions in the same order (`follow`), so collectives inside them
line up. A refused action (a ValueError) is reported to the client by rank 0; followers go on.
"""

from __future__ import annotations

import logging
from enum import Enum
from typing import Any

import torch.distributed as dist

from rollfleet.engine.model import ModelRunner

log = logging.getLogger("rollfleet.engine")


class Action(Enum):
    """A lockstep action; its value is the path of the method it runs on a ModelRunner."""

    PREFILL = "prefill"
    DECODE = "decode"
    KEEP_ROWS = "keep_rows"
    END_BATCH = "end_batch"
    UPDATE_WEIGHTS_FROM_DISK = "weights.from_disk"
    UPDATE_WEIGHTS_FROM_TENSOR = "weights.from_tensor"
    UPDATE_WEIGHTS_FROM_DISTRIBUTED = "weights.from_distributed"
    DROP_HELD_PAYLOADS = "weights.drop_held_payloads"
    INIT_WEIGHTS_UPDATE_GROUP = "weights.groups.join"
    DESTROY_WEIGHTS_UPDATE_GROUP = "weights.groups.destroy"
    GET_WEIGHTS_BY_NAME = "get_weights_by_name"
    SHARD_FINGERPRINTS = "shard_fingerprints"
    WEIGHTS_FINGERPRINT = "weights_fingerprint"
    LOAD_LORA_ADAPTER = "lora.load"
    UNLOAD_LORA_ADAPTER = "lora.unload"
    LORA_FINGERPRINTS = "lora.fingerprints"
    MEMORY = "memory"
    RELEASE_MEMORY = "release_memory"
    RESUME_MEMORY = "resume_memory"
    SHUTDOWN = "shutdown"  # followers stop; runs nothing

    def run(self, runner: ModelRunner, kwargs: dict[str, Any]) -> Any:
        target = runner
        for part in self.value.split("."):
            target = getattr(target, part)
        return target(**kwargs)


class Lockstep:
    """Rank 0's side: announce an action to every rank, then run it here."""

    def __init__(self, runner: ModelRunner, group: dist.ProcessGroup | None):
        self.runner, self.group = runner, group

    def __call__(self, action: Action, **kwargs) -> Any:
        if self.group is not None:
            dist.broadcast_object_list([(action.value, kwargs)], src=0, group=self.group)
        return None if action is Action.SHUTDOWN else action.run(self.runner, kwargs)


def follow(runner: ModelRunner, group: dist.ProcessGroup) -> None:
    """A follower rank: run whatever rank 0 announces, until it says shutdown."""
    while True:
        box = [None]
        try:
            dist.broadcast_object_list(box, src=0, group=group)
        except RuntimeError as exc:  # rank 0 exited (stopped or crashed): nothing left to follow
            log.warning("follower: rank 0 is gone (%s); exiting", str(exc).splitlines()[0][:200])
            return
        name, kwargs = box[0]
        action = Action(name)
        if action is Action.SHUTDOWN:
            return
        try:
            action.run(runner, kwargs)
        except ValueError:  # refused updates are reported to the client by rank 0
            pass
