"""Restore sources: where an engine that holds no verified weights (restarted, or left by a failed push)
gets the fleet's version from, tried in order by `Recovery`.

A source only *loads* weights into engines and says what they must then report (a `SyncReport`);
it changes no state. Recovery runs it under the restore's deadline (`rollout.restore_timeout_s`),
verifies every engine on its own, and moves each verified one to ACTIVE under its lock. The order
today: a peer engine at the fleet's version (R-Fork, rollfleet.fleet.peer_restore), a checkpoint of
exactly the fleet's version (registered by the trainer, or left by the disk transport), in a LoRA
run the adapter of the fleet's version on top of the base weights (`AdapterRestore`), then "wait for
the trainer's next push" (loads nothing).
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Protocol

from rollfleet.config import TensorSync
from rollfleet.fleet.lifecycle import EngineSlot
from rollfleet.fleet.weight_sends import WeightSends
from rollfleet.weights.adapter import SavedAdapter
from rollfleet.weights.checkpoint import CheckpointSource
from rollfleet.weights.transports import SyncReport
from rollfleet.weights.transports.base import transport_class
from rollfleet.weights.verify import find_unverified
from rollfleet.wire.pool import EnginePool


class RestoreError(RuntimeError):
    """An explicit restore (`Fleet.restore`) left engines unverified."""


class RestoreSource(Protocol):
    name: str  # for logs and for remembering which source failed which engine at which version

    def available(self, version: str, slot: EngineSlot) -> bool:
        """Whether this source can give `slot` the weights of `version` now (cheap: no engine call)."""
        ...

    def restore(self, slots: list[EngineSlot], version: str, deadline: float) -> SyncReport | None:
        """Load `version` into the engines (raising on failure); what they must now report, or None
        when this source loads nothing (the engines wait). `deadline` is a `time.monotonic()` time:
        Recovery gives up on the call then, so a source may use it to size its own timeouts."""
        ...


class CheckpointRestore:
    """A HF directory holding exactly the version. Each engine loads it itself
    (`/update_weights_from_disk`); with `fan_out=True` it is read once here and fanned out over the
    tensor transport (shared memory on CPU, CUDA IPC on GPU; same node) instead. Each engine reading
    is the default because it measured faster wherever it was measured (docs/benchmarks.md, Recovery:
    2 x H200, 2.9 GB, page cache warm, 0.62 s against 1.33 s; CPU 0.05 s against 0.19 s): one node's
    page cache serves every engine. Fan-out stays for storage slow to read twice (a cold network
    file system), which this project could not measure."""

    name = "checkpoint"

    def __init__(self, sends: WeightSends, directory_for: Callable[[str], str | None], fan_out: bool = False):
        self.sends, self.directory_for, self.fan_out = sends, directory_for, fan_out

    def available(self, version: str, slot: EngineSlot) -> bool:
        return self.directory_for(version) is not None

    def restore(self, slots: list[EngineSlot], version: str, deadline: float) -> SyncReport:
        directory = self.directory_for(version)
        if directory is None:
            raise RestoreError(f"no checkpoint holds version {version!r} any more")
        engine_ids = [s.engine_id for s in slots]
        if self.fan_out and len(engine_ids) > 1:
            source, targets = CheckpointSource(directory), self.sends.weight_targets(engine_ids)
            timeout_s = max(1.0, deadline - time.monotonic())
            return self.sends.send_weights(source, version, targets, TensorSync(), timeout_s=timeout_s)
        self.sends.pool.on_all("update_weights_from_disk", engine_ids, directory, weight_version=version)
        return self.sends.expected_from_checkpoint(directory, version, engine_ids)


class AdapterRestore:
    """A LoRA run: the engine holds the base weights (a restart or a standby loads them from the model
    path; a failed adapter push never touches them) and gets the adapter of the version from the
    directory that version's sync left (`saved_adapter` of the transport), sent as that sync sent
    it (the same served name, fingerprints and version), so it is verified like the push."""

    name = "adapter"

    def __init__(self, sends: WeightSends):
        self.sends = sends

    def _directory(self, version: str, wait_s: float = 0.0) -> str | None:
        spec = self.sends.cfg.weight_sync
        return transport_class(spec).saved_adapter(spec, version, wait_s=wait_s)

    def available(self, version: str, slot: EngineSlot) -> bool:
        """Never waits (it is asked under recovery's lock): a directory whole or being written."""
        spec = self.sends.cfg.weight_sync
        return self._directory(version) is not None or transport_class(spec).writing_adapter(spec, version)

    def restore(self, slots: list[EngineSlot], version: str, deadline: float) -> SyncReport:
        # the sync of `version` may still be writing its directory: waited for within the deadline
        directory = self._directory(version, wait_s=max(0.0, deadline - time.monotonic()))
        if directory is None:
            raise RestoreError(f"no adapter directory holds version {version!r} any more")
        targets = self.sends.weight_targets([s.engine_id for s in slots])
        timeout_s = max(1.0, deadline - time.monotonic())
        spec = self.sends.cfg.weight_sync
        return self.sends.send_weights(SavedAdapter(directory), version, targets, spec, timeout_s=timeout_s)


class WaitForPush:
    """The last resort: nothing is loaded; the engines stay AWAITING_WEIGHTS (no traffic) and take
    the trainer's next push, verified like any push."""

    name = "next push"

    def available(self, version: str, slot: EngineSlot) -> bool:
        return True

    def restore(self, slots: list[EngineSlot], version: str, deadline: float) -> None:
        return None


def run_before(fn: Callable[[], object], deadline: float) -> tuple[Future, threading.Thread]:
    """Run `fn` in a thread of its own and wait for it until `deadline` (`time.monotonic()`); the
    future raises `TimeoutError` then, and the thread is left to end on its own (the caller makes
    sure it does, by killing the engine it waits on)."""
    future: Future = Future()

    def go():
        try:
            future.set_result(fn())
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
            future.set_exception(exc)

    thread = threading.Thread(target=go, name="rollfleet-restore", daemon=True)
    thread.start()
    try:
        future.result(timeout=max(0.0, deadline - time.monotonic()))
    except BaseException:  # noqa: BLE001 - the caller reads the future
        pass
    return future, thread


def verify_each(pool: EnginePool, mode: str, report: SyncReport, engine_ids: list[int]) -> dict[int, str | None]:
    """Engine id -> what is wrong with it (None: verified in `mode`, the run's verify_mode), each
    engine checked on its own, so one that does not answer fails only itself."""

    async def one(engine_id: int) -> str | None:
        if engine_id in report.failed:  # the source could not load it (a peer's pull that failed)
            return report.failed[engine_id]
        alone = dataclasses.replace(report, engine_ids=[engine_id])
        try:
            return (await find_unverified(alone, {engine_id: pool.client(engine_id)}, mode)).get(engine_id)
        except Exception as exc:  # noqa: BLE001 - a dead or hung engine: its own verification fails
            return f"not answering: {exc!r:.200}"

    async def every():
        return await asyncio.gather(*(one(e) for e in engine_ids))

    return dict(zip(engine_ids, pool.run(every())))
