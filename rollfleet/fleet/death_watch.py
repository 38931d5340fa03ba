"""Detection, recovery's first part: the death watch sees an engine process exit at once, and health
probes catch a hung engine (alive, not answering). Either marks the engine INACTIVE through
Recovery's `mark_dead` (under its one lock), which wakes the restarter.

Ordering, stated here: detection marks an engine INACTIVE (death watch: its process exited, seen at
once; probes of every ACTIVE or AWAITING_WEIGHTS engine, so also of one being restored:
`probe_failures` consecutive /health probes slower than `probe_timeout_s`, then the process is
killed so the restart starts clean). Only an engine whose url is still the one watched changes
(`mark_dead(url=...)`): an engine being restarted on purpose is RECOVERING and stays so.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import ray

from rollfleet.config import RolloutConfig
from rollfleet.fleet.lifecycle import EngineSlot, EngineState
from rollfleet.wire.pool import EnginePool


class DeathWatch:
    """Two threads (`threads`, started and joined by Recovery) that end once `closing` is set."""

    def __init__(
        self,
        slots: list[EngineSlot],
        pool: EnginePool,
        rollout: RolloutConfig,
        mark_dead: Callable[..., bool],
        closing: threading.Event,
    ):
        self.slots, self.pool, self.rollout = slots, pool, rollout
        self._mark_dead, self._closing = mark_dead, closing
        self.threads = [
            threading.Thread(target=target, name=f"rollfleet-{name}", daemon=True)
            for name, target in (("death-watch", self._watch_exits), ("probe", self._probe))
        ]

    def _watch_exits(self) -> None:
        """Notice an engine process exit at once: one blocking wait per running engine on its head
        worker; when it returns, the engine is INACTIVE (unless it is being restarted on purpose)."""
        waits: dict[int, tuple[ray.ObjectRef, str]] = {}
        while not self._closing.is_set():
            for slot in self.slots:
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
                    self._mark_dead(self.slots[engine_id], f"engine process exited (code {code})", url=url)

    def _probe(self) -> None:
        """Catch hung engines (alive but not answering), serving or being restored: `probe_failures`
        consecutive /health probes slower than `probe_timeout_s` mark it INACTIVE and kill its process."""
        failures: dict[str, int] = {}  # by url: a restarted engine starts from zero
        watched = (EngineState.ACTIVE, EngineState.AWAITING_WEIGHTS)
        while not self._closing.wait(self.rollout.probe_interval_s):
            slots = [(s, s.url) for s in self.slots if s.state in watched]
            answers = self.pool.on_all("health", [s.engine_id for s, _ in slots], self.rollout.probe_timeout_s)
            failures = {url: 0 if ok else failures.get(url, 0) + 1 for (_, url), ok in zip(slots, answers)}
            for slot, url in slots:
                if failures[url] >= self.rollout.probe_failures:
                    self._mark_dead(slot, f"{failures[url]} health probes failed", url=url, kill=True)
                    failures[url] = 0

    def wait_for_failure(self, marks: dict[int, int], grace_s: float = 2.0) -> bool:
        """Whether an engine failed (INACTIVE, or on to RECOVERING) since `marks` (engine id -> its
        lifecycle's mark), now or within the death watch's reaction time."""
        deadline = time.monotonic() + grace_s
        while True:
            if any(self.slots[e].lifecycle.failed_since(mark) for e, mark in marks.items()):
                return True
            if time.monotonic() >= deadline:
                return False
            self._closing.wait(0.05)
