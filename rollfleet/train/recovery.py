"""The GRPO loop's recovery snapshots: when one is due, the skip while the last is still being
written, and the fleet's registration of each once it is complete.

Which runs write them is `RunConfig.recovery_snapshot_every` ('auto': a single-engine fleet only;
with 2+ engines a peer or the trainer's next push restores a dead one). The trainer takes a host
copy of the weights it just pushed on a thread while the engines generate, and writes it on another
(rollfleet.train.snapshot, TrainWorker.start_snapshot); the step goes on at once. The fleet learns
of a snapshot only when its directory is complete (`Fleet.register_checkpoint`, from the write's
completion callback), so a restore never reads a half-written one.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path

from rollfleet.fleet.fleet import Fleet
from rollfleet.train.worker import TrainerGroup

log = logging.getLogger("rollfleet.train")


class RecoverySnapshots:
    def __init__(self, every: int, fleet: Fleet, trainers: TrainerGroup, root: Path):
        self.every, self.fleet, self.trainers, self.root = every, fleet, trainers, root
        self.pending: Future | None = None  # the write under way (or the last one)
        self._written: list[dict] = []  # results finished since `take_written`
        self._lock = threading.Lock()

    def after_sync(self, step: int, version: str) -> dict:
        """Start the snapshot of `version` (just pushed; the trainer is onloaded) when one is due and
        the last is written; else count a skip. Returns snapshot_skipped. The step waits for neither
        the host copy (a thread of the trainer, while the engines generate) nor the write."""
        figures = {"snapshot_skipped": 0}
        if not self.every or step % self.every or self.fleet.checkpoint_for(version) is not None:
            return figures  # not due, or a checkpoint of this version already serves (disk sync)
        if self.pending is not None and not self.pending.done():
            figures["snapshot_skipped"] = 1
            return figures
        self.trainers.start_snapshot(version, str(self.root), self._engine_dtype())
        self.pending = self.trainers.snapshot_written().future()
        self.pending.add_done_callback(self._on_written)
        return figures

    def _engine_dtype(self) -> str | None:
        """The dtype every engine serves in (the snapshot is written in it: half the bytes of fp32 on a
        bf16 GPU fleet, the same values a push delivers); None (the trainer's fp32) when unknown."""
        dtypes = {slot.dtype for slot in self.fleet.slots if slot.dtype}
        return dtypes.pop() if len(dtypes) == 1 else None

    def _on_written(self, future: Future) -> None:
        try:
            result = future.result()
        except Exception as exc:  # noqa: BLE001 - a failed snapshot costs a restore source, not the run
            log.warning("recovery snapshot failed (its partial directory was removed): %r", exc)
            return
        if result is None:
            return
        self.fleet.register_checkpoint(result["version"], result["directory"])
        log.info("recovery snapshot of version %s written in %.2f s", result["version"], result["seconds"])
        with self._lock:
            self._written.append(result)

    def take_written(self) -> list[dict]:
        """Snapshots completed (and registered) since the last call."""
        with self._lock:
            written, self._written = self._written, []
        return written

    def close(self, timeout_s: float = 120.0) -> None:
        """Wait for a write under way up to `timeout_s`, then cancel it (its partial directory goes)."""
        if self.pending is None or self.pending.done():
            return
        try:
            self.pending.result(timeout_s)
        except FutureTimeout:
            log.warning("recovery snapshot still writing after %.0f s: cancelled", timeout_s)
            self.trainers.cancel_snapshot()
        except Exception:  # noqa: BLE001 - already logged by _on_written
            pass
