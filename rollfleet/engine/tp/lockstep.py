"""Lockstep execution across the tp ranks of one engine.

Rank 0 decides: `Lockstep(Action.X, **kwargs)` broadcasts the action and its arguments on the
gloo control group, then runs it on rank 0's `ModelRunner` and returns rank 0's result. Every
follower rank runs the same actions in the same order (`follow`), so collectives inside them
line up. A refused action (a ValueError) is reported to the client by rank 0; followers go on.

A batch action (prefill, decode, keep_rows) that fails on a follower fails there as on rank 0:
the follower logs it and waits for rank 0's next action. When the batch failed on rank 0 too (the
same inputs fail alike on every rank, e.g. before any collective), rank 0 finishes the batch's
requests as aborted with its reason and announces end_batch; every rank drops the batch and the
loop goes on. When rank 0 went on with the batch instead (it succeeded where this rank failed),
or announces nothing within FAILED_BATCH_WAIT_S (it waits in a collective this rank left), the
ranks' states differ: the follower exits, and rank 0 stops the engine (server.py) as before.
"""

from __future__ import annotations

import logging
import os
import threading
from enum import Enum
from typing import Any

import torch.distributed as dist

ModelRunner = Any  # model.py's runner, not imported: the runner imports the KV cache, which imports Action

log = logging.getLogger("rollfleet.engine")
FAILED_BATCH_WAIT_S = 60.0


class Action(Enum):
    """A lockstep action; its value is the path of the method it runs on a ModelRunner."""

    PREFILL = "prefill"
    DECODE = "decode"
    KEEP_ROWS = "keep_rows"
    END_BATCH = "end_batch"
    STEP = "paged.step"  # the paged KV pool's one step (kv/paged.py)
    ALLOCATE_KV = "paged.allocate"
    UPDATE_WEIGHTS_FROM_DISK = "update_weights_from_disk"
    UPDATE_WEIGHTS_FROM_TENSOR = "weights.from_tensor"
    UPDATE_WEIGHTS_FROM_DISTRIBUTED = "weights.from_distributed"
    DROP_HELD_PAYLOADS = "weights.drop_held_payloads"
    INIT_WEIGHTS_UPDATE_GROUP = "weights.groups.join"
    DESTROY_WEIGHTS_UPDATE_GROUP = "weights.groups.destroy"
    REMOTE_INSTANCE_JOIN = "remote.join"  # R-Fork (remote_instance.py)
    REMOTE_INSTANCE_SEND = "remote.send"
    REMOTE_INSTANCE_RECEIVE = "remote.receive"
    REMOTE_INSTANCE_DESTROY = "remote.destroy"
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


BATCH_ACTIONS = frozenset({Action.PREFILL, Action.DECODE, Action.KEEP_ROWS, Action.STEP})


class LockstepBroken(RuntimeError):
    """This follower's state no longer matches rank 0's: it cannot follow any more."""


def follow(runner: ModelRunner, group: dist.ProcessGroup) -> None:
    """A follower rank: run whatever rank 0 announces, until it says shutdown."""
    failed: str | None = None  # why this rank's part of the running batch failed
    while True:
        box = [None]
        watchdog = _exit_unless_announced(failed) if failed is not None else None
        try:
            dist.broadcast_object_list(box, src=0, group=group)
        except RuntimeError as exc:  # rank 0 exited (stopped or crashed): nothing left to follow
            log.warning("follower: rank 0 is gone (%s); exiting", str(exc).splitlines()[0][:200])
            return
        finally:
            if watchdog is not None:
                watchdog.cancel()
        name, kwargs = box[0]
        action = Action(name)
        if action is Action.SHUTDOWN:
            return
        if failed is not None and action is not Action.END_BATCH:
            raise LockstepBroken(f"this rank failed the running batch ({failed}), rank 0 went on with {name}")
        failed = None
        try:
            action.run(runner, kwargs)
        except Exception as exc:
            if action in BATCH_ACTIONS:  # as on rank 0: the batch fails, the loop goes on
                log.exception("follower: %s failed; waiting for rank 0 to end the batch", name)
                failed = f"{type(exc).__name__}: {str(exc).strip()[:200]}"
            elif not isinstance(exc, ValueError):  # refused updates are reported to the client by rank 0
                raise


def _exit_unless_announced(failed: str) -> threading.Timer:
    """After a failed batch action rank 0 announces its next action at once, unless it waits in a
    collective this rank left: then exit (rank 0 stops the engine) instead of hanging both."""

    def give_up():
        log.error(
            "follower: no action from rank 0 %.0f s after this rank failed (%s); exiting", FAILED_BATCH_WAIT_S, failed
        )
        os._exit(1)

    timer = threading.Timer(FAILED_BATCH_WAIT_S, give_up)
    timer.daemon = True
    timer.start()
    return timer
