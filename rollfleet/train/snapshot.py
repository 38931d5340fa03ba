"""Recovery snapshots written in the background, off the step's critical path.

A snapshot is the synced weights as a HF directory that a restarted engine can restore from. The
step only pays for a host copy of the weights (`take_host_copy`: full tensors gathered into host
buffers reused across steps, pinned on a GPU); `SnapshotWriter` writes that copy on its own thread
while the next step runs.

Ordering, stated once:
- One write at a time. `start` refuses (returns None) while the last write runs, and its caller
  counts the skip: a step never waits for the disk.
- The host copy is not touched again until its write ends (the caller takes a new copy only when
  `start` would accept it).
- A write goes to `<root>/version-<v>.partial` and is renamed to `version-<v>` only when complete;
  an error, a cancel or a killed process leaves at most a `.partial` directory, which no restore
  takes (only directories a finished write reports are registered) and the next writer removes.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import torch

from rollfleet.train.host_copy import HostBuffers, settle
from rollfleet.weights.checkpoint import PARTIAL, partial_of, prune_versions, save_checkpoint
from rollfleet.weights.source import WeightSource

log = logging.getLogger("rollfleet.snapshot")


class SnapshotCancelled(Exception):
    """The write was cancelled (the run is closing); its partial directory is removed."""


@dataclass(frozen=True)
class SnapshotResult:
    version: str
    directory: str
    seconds: float  # the background write, from start to rename
    bytes: int


def take_host_copy(
    source: WeightSource, buffers: HostBuffers, device: torch.device, *, keep: bool, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """Full tensors of `source` in `buffers` (cast to `dtype`), in checkpoint naming. Every rank of a
    sharded source calls it (the gathers are collective); ranks with `keep=False` get {}."""
    copy = {}
    with torch.no_grad():
        for name, tensor in source.named_tensors():
            if keep:
                copy[name] = buffers.copy_in(name, tensor, dtype)
    settle(device)
    return copy


class SnapshotWriter:
    """Writes host copies under `root` as `version-<v>` directories, one at a time, on a thread."""

    def __init__(self, root: str | Path, config_dir: str | Path, *, keep: int = 2, shard_bytes: int = 5 << 30):
        self.root, self.config_dir = Path(root), Path(config_dir)
        self.keep, self.shard_bytes = keep, shard_bytes
        self._cancel = threading.Event()
        self._thread: threading.Thread | None = None
        self._future: Future | None = None
        self.root.mkdir(parents=True, exist_ok=True)
        for stale in self.root.glob(f"version-*{PARTIAL}"):  # left by a killed run: never complete
            shutil.rmtree(stale, ignore_errors=True)

    @property
    def busy(self) -> bool:
        """A write has started and not ended (its future is the last thing it sets: a caller that saw
        the future done may start the next one at once)."""
        return self._future is not None and not self._future.done()

    def start(self, version: str, tensors: Mapping[str, torch.Tensor]) -> Future | None:
        """Begin writing `tensors` as version `version`; None (nothing started) while a write runs.
        The future resolves to a SnapshotResult, or raises what stopped the write."""
        if self.busy:
            return None
        self._cancel.clear()
        future: Future = Future()
        self._future = future
        self._thread = threading.Thread(
            target=self._write, args=(version, tensors, future), name=f"rollfleet-snapshot-{version}", daemon=True
        )
        self._thread.start()
        return future

    def wait(self, timeout: float | None = None) -> SnapshotResult | None:
        """The last write's result once it ends (None if none was started); raises its error."""
        return None if self._future is None else self._future.result(timeout)

    @property
    def cancelling(self) -> bool:
        """Whether a close asked the write under way to stop (it does at its next tensor)."""
        return self._cancel.is_set()

    def close(self, *, cancel: bool = False, timeout: float | None = None) -> None:
        """Wait for the write under way, or with `cancel` stop it (its partial directory is removed)."""
        if cancel:
            self._cancel.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _write(self, version: str, tensors: Mapping[str, torch.Tensor], future: Future) -> None:
        final = self.root / f"version-{version}"
        start = time.perf_counter()
        try:
            nbytes = save_checkpoint(
                self._until_cancelled(tensors), final, config_dir=self.config_dir, shard_bytes=self.shard_bytes
            )
            prune_versions(self.root, keep=self.keep)
        except BaseException as exc:  # noqa: BLE001 - handed to the future; the partial must not stay
            shutil.rmtree(partial_of(final), ignore_errors=True)
            future.set_exception(exc)
            return
        result = SnapshotResult(version, str(final), time.perf_counter() - start, nbytes)
        log.info("snapshot of version %s: %.1f MB written in %.2f s", version, nbytes / 1e6, result.seconds)
        future.set_result(result)

    def _until_cancelled(self, tensors: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in tensors.items():
            if self._cancel.is_set():
                raise SnapshotCancelled("snapshot cancelled: the run is closing")
            yield name, tensor
