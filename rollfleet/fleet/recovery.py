"""Recovery of dead engines, all under one lock: a death watch, health probes, restarts (also in the
background) and the restore sources.

Ordering, stated once:
- Detection marks an engine INACTIVE (death watch: its process exited, seen at once; probes:
  `probe_failures` consecutive /health probes slower than `probe_timeout_s`, then the process is
  killed so the restart starts clean). Only a running engine whose url is still the one watched
  changes: an engine being restarted on purpose is RECOVERING and stays so.
- One restart at a time (`restart_inactive`, from the caller or the background thread): INACTIVE ->
  RECOVERING -> new process with the transport's restart load format -> AWAITING_WEIGHTS (no
  traffic; the engine itself refuses generate) -> restore of the fleet's version from a checkpoint
  holding exactly that version, verified -> ACTIVE. Without such a checkpoint the engine waits for
  the trainer's next push.
- `paused()` waits for a restart under way and keeps the background thread from starting one (a
  colocated trainer holds the GPUs).
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import contextmanager
from typing import TYPE_CHECKING

import ray

from rollfleet.config import TensorSync
from rollfleet.fleet.lifecycle import FAILED, EngineSlot, EngineState
from rollfleet.weights.checkpoint import CheckpointSource
from rollfleet.weights.transports.base import transport_class

if TYPE_CHECKING:
    from rollfleet.fleet.fleet import Fleet

log = logging.getLogger("rollfleet.recovery")


class Recovery:
    def __init__(self, fleet: Fleet):
        self.fleet, self.rollout = fleet, fleet.rollout
        self._lock = threading.Condition()  # the one lock: every state change made here, and the restarts
        self._restarting = False
        self._pauses = 0
        self._checkpoints: dict[str, str] = {}  # version -> HF directory (insertion order)
        self._closing = threading.Event()
        self._threads = [
            threading.Thread(target=target, name=f"rollfleet-{name}", daemon=True)
            for name, target in (
                ("death-watch", self._watch_exits),
                ("probe", self._probe),
                ("restarter", self._restart_in_background),
            )
        ]
        for thread in self._threads:
            thread.start()

    def close(self) -> None:
        self._closing.set()
        for thread in self._threads:
            thread.join(timeout=60)

    def mark_dead(self, slot: EngineSlot, why: str, *, url: str | None = None) -> None:
        """INACTIVE, unless it is already failed or (with `url`) has been restarted since."""
        with self._lock:
            if slot.state not in FAILED and (url is None or slot.url == url):
                slot.lifecycle.to(EngineState.INACTIVE, why)

    # ---- detection ------------------------------------------------------------------------------
    def _watch_exits(self) -> None:
        """Notice an engine process exit at once: one blocking wait per running engine on its head
        worker; when it returns, the engine is INACTIVE (unless it is being restarted on purpose)."""
        waits: dict[int, tuple[ray.ObjectRef, str]] = {}
        while not self._closing.is_set():
            for slot in self.fleet.slots:
                if slot.is_running and slot.engine_id not in waits:
                    waits[slot.engine_id] = (slot.head.wait_engine_exit.remote(), slot.url)
            if not waits:
                self._closing.wait(0.1)
                continue
            ready, _ = ray.wait([ref for ref, _ in waits.values()], num_returns=1, timeout=0.2)
            for engine_id, (ref, url) in list(waits.items()):
                if ref in ready:
                    del waits[engine_id]
                    try:
                        code = ray.get(ref)
                    except ray.exceptions.RayError as exc:  # the worker itself is gone (node loss)
                        code = repr(exc)
                    self.mark_dead(self.fleet.slots[engine_id], f"engine process exited (code {code})", url=url)

    def _probe(self) -> None:
        """Catch hung engines (alive but not answering): `probe_failures` consecutive /health probes
        slower than `probe_timeout_s` mark an ACTIVE engine INACTIVE and stop its process."""
        failures: dict[int, int] = {}
        while not self._closing.wait(self.rollout.probe_interval_s):
            active = [s for s in self.fleet.slots if s.state == EngineState.ACTIVE]
            answers = self.fleet.pool.on_all("health", [s.engine_id for s in active], self.rollout.probe_timeout_s)
            for slot, ok in zip(active, answers):
                failures[slot.engine_id] = 0 if ok else failures.get(slot.engine_id, 0) + 1
                if failures[slot.engine_id] < self.rollout.probe_failures:
                    continue
                with self._lock:
                    if slot.state == EngineState.ACTIVE:
                        slot.lifecycle.to(EngineState.INACTIVE, f"{failures[slot.engine_id]} health probes failed")
                        slot.head.kill_engine.remote()  # a hung process is ended, so the restart starts clean
                failures[slot.engine_id] = 0

    # ---- restarts -------------------------------------------------------------------------------
    def _restart_in_background(self) -> None:
        while not self._closing.wait(self.rollout.probe_interval_s):
            if not self.rollout.auto_restart:
                continue
            try:
                self.restart_inactive(background=True)
            except Exception:  # noqa: BLE001 - logged; the next round (or the caller) tries again
                log.exception("background restart failed")

    @contextmanager
    def paused(self):
        """No background restart starts inside this block, and none is under way in it."""
        with self._lock:
            self._pauses += 1
            self._lock.wait_for(lambda: not self._restarting)
        try:
            yield
        finally:
            with self._lock:
                self._pauses -= 1

    def restart_inactive(
        self, restore_from: str | None = None, *, restore: bool = True, background: bool = False
    ) -> list[int]:
        """Restart every INACTIVE engine with the transport's restart load format (AWAITING_WEIGHTS:
        not ready, no traffic), then restore the fleet's current version from `restore_from` or a
        checkpoint of exactly that version, sent only to them, and verify; without one they wait for
        the trainer's next push. Returns the restarted engine ids."""
        with self._lock:
            if background and self._pauses:
                return []
            self._lock.wait_for(lambda: not self._restarting)
            slots = [s for s in self.fleet.slots if s.state == EngineState.INACTIVE]
            if not slots:
                return []
            self._restarting = True
            for slot in slots:
                slot.lifecycle.to(EngineState.RECOVERING, "restart")
        try:
            restarted = self._start_again(slots)
            directory = restore_from or self.checkpoint_for(self.fleet.version)
            if restarted and directory and restore:
                self.restore(directory, self.fleet.version, restarted)
            return restarted
        finally:
            with self._lock:
                self._restarting = False
                self._lock.notify_all()

    def _start_again(self, slots: list[EngineSlot]) -> list[int]:
        ray.get([s.head.stop_engine.remote() for s in slots])
        load_format = transport_class(self.fleet.cfg.weight_sync).restart_load_format
        starts = [s.head.start_engine.remote(s.gpu_ids, load_format) for s in slots]
        restarted = []
        for slot, start in zip(slots, starts):
            try:
                url = ray.get(start)["url"]
            except ray.exceptions.RayError as exc:
                with self._lock:
                    slot.lifecycle.to(EngineState.INACTIVE, f"restart failed: {exc}")
                continue
            self.fleet.engine_started(slot, url)
            with self._lock:
                slot.lifecycle.to(EngineState.AWAITING_WEIGHTS, f"restarted with {load_format} weights")
            restarted.append(slot.engine_id)
        return restarted

    def restore(self, directory: str, version: str, engine_ids: list[int], *, fan_out: bool | None = None) -> None:
        """Load a checkpoint into some engines and verify them (never advancing the fleet's version).
        With several engines the files are read once here and the tensors fanned out over the tensor
        transport (shared memory on CPU, CUDA IPC on GPU; same node), instead of each engine reading."""
        if fan_out if fan_out is not None else len(engine_ids) > 1:
            self.fleet.sync_weights(
                CheckpointSource(directory), version, engine_ids=engine_ids, transport=TensorSync(), advance=False
            )
        else:
            self.fleet.update_weights_from_disk(directory, version, engine_ids=engine_ids, advance=False)

    # ---- restore sources ------------------------------------------------------------------------
    def register_checkpoint(self, version: str, directory: str) -> None:
        """A HF directory holding `version` (the trainer saves one for recovery); the newest two are kept."""
        with self._lock:
            self._checkpoints[version] = directory
            for old in list(self._checkpoints)[:-2]:
                del self._checkpoints[old]

    def checkpoint_for(self, version: str) -> str | None:
        """A checkpoint directory holding exactly `version`: registered by the trainer, or one the
        transport's own syncs left; None when there is none (restarted engines then wait for a push)."""
        with self._lock:
            registered = self._checkpoints.get(version)
        spec = self.fleet.cfg.weight_sync
        return registered or transport_class(spec).restore_checkpoint(spec, version)

    def wait_for_failure(self, marks: dict[int, int], grace_s: float = 2.0) -> bool:
        """Whether an engine failed (INACTIVE, or on to RECOVERING) since `marks` (engine id -> its
        lifecycle's mark), now or within the death watch's reaction time."""
        deadline = time.monotonic() + grace_s
        while True:
            if any(s.lifecycle.failed_since(marks.get(s.engine_id, 0)) for s in self.fleet.slots):
                return True
            if time.monotonic() >= deadline:
                return False
            self._closing.wait(0.05)
