"""Restores, recovery's last part: every serving engine AWAITING_WEIGHTS (restarted, a promoted
standby, or left by a push that failed part-way) gets the fleet's version from the restore sources
(rollfleet.fleet.restore) in order. Recovery calls it with the gate held for restoring (no push
overlaps a restore).

Ordering, stated here: the sources in order (a peer engine at the fleet's version, a checkpoint of
it, in a LoRA run the adapter of it, the next push), each engine verified on its own and ACTIVE once
verified, whatever happens to the others; only an engine still AWAITING_WEIGHTS at the url it was
restored at becomes ACTIVE (under Recovery's lock: a restore never revives an engine that died
meanwhile). A source that fails an engine while no engine of its restore died is not tried again for
that engine at that version; with no source left the engine waits for the trainer's next push. A
restore is bounded by `restore_timeout_s`, after which the engines that do not answer /health are
killed (INACTIVE) and the others keep waiting. No call blocks while the lock is held.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from rollfleet.config import RunConfig
from rollfleet.fleet import standby
from rollfleet.fleet.lifecycle import EngineSlot, EngineState
from rollfleet.fleet.restore import RestoreSource, WaitForPush, run_before, verify_each
from rollfleet.wire.pool import EnginePool

log = logging.getLogger("rollfleet.recovery")


class Restorer:
    def __init__(
        self,
        cfg: RunConfig,
        slots: list[EngineSlot],
        pool: EnginePool,
        lock: threading.Condition,
        mark_dead: Callable[..., bool],
    ):
        self.cfg, self.rollout, self.slots, self.pool = cfg, cfg.rollout, slots, pool
        self._lock, self._mark_dead = lock, mark_dead  # Recovery's one lock and its mark_dead
        self.failed_restores: set[tuple[str, str, str]] = set()  # (source, version, engine url): not again

    def restorable(self, sources: list[RestoreSource], version: str) -> bool:
        """Whether a source (other than waiting) may restore an AWAITING_WEIGHTS engine now."""
        sources = [s for s in sources if not isinstance(s, WaitForPush)]
        return any(self._may_try(source, version, slot) for source in sources for slot in self.awaiting())

    def awaiting(self) -> list[EngineSlot]:
        """Serving engines waiting for weights (standbys wait for a place, not for weights)."""
        return [s for s in standby.in_rotation(self.slots) if s.state == EngineState.AWAITING_WEIGHTS]

    def _may_try(self, source: RestoreSource, version: str, slot: EngineSlot) -> bool:
        return (source.name, version, slot.url) not in self.failed_restores and source.available(version, slot)

    def restore(
        self, slots: list[EngineSlot], sources: list[RestoreSource], version: str, *, remember=True
    ) -> list[int]:
        """Each source in turn for the engines it is available to, until every engine is verified;
        all under one deadline. The engines left unverified (still AWAITING_WEIGHTS, or INACTIVE)."""
        deadline = time.monotonic() + self.rollout.restore_timeout_s
        self.failed_restores = {key for key in self.failed_restores if key[1] == version}
        pending = list(slots)
        for source in sources:
            for _ in range(2):  # a second go only for the survivors of an engine that died meanwhile
                batch = [s for s in pending if s.state == EngineState.AWAITING_WEIGHTS]
                batch = [s for s in batch if self._may_try(source, version, s)]
                if not batch or time.monotonic() >= deadline:
                    break
                verified, died = self._restore_batch(source, batch, version, deadline, remember)
                pending = [s for s in pending if s.engine_id not in verified]
                if not died:
                    break
        return [s.engine_id for s in pending]

    def _restore_batch(
        self, source: RestoreSource, batch: list[EngineSlot], version: str, deadline: float, remember: bool
    ) -> tuple[list[int], bool]:
        """One source for some engines: load, verify each, and (under the lock) ACTIVE for each verified
        engine still waiting at the url it was restored at. The verified ids, and whether an engine
        of the batch failed meanwhile (then the others are not to blame)."""
        urls = {s.engine_id: s.url for s in batch}
        marks = {s.engine_id: s.lifecycle.mark() for s in batch}
        ids = list(urls)

        def load_and_verify():
            report = source.restore(batch, version, deadline)
            return None if report is None else verify_each(self.pool, self.cfg.verify_mode, report, ids)

        future, thread = run_before(load_and_verify, deadline)
        if not future.done():
            self._give_up(batch, urls, f"restore from {source.name} not done in {self.rollout.restore_timeout_s} s")
            thread.join(timeout=2 * self.rollout.probe_timeout_s)  # its calls fail now that the hung engine is gone
            problems = {e: "restore timed out" for e in ids}
        elif future.exception() is not None:
            problems = {e: f"{source.name} failed: {future.exception()!r:.300}" for e in ids}
        elif (problems := future.result()) is None:
            log.info("engines %s wait for the trainer's next push (no source restored them)", ids)
            return [], False
        died = any(s.lifecycle.failed_since(marks[s.engine_id]) for s in batch)
        verified = []
        with self._lock:
            for slot in batch:
                problem, same = problems[slot.engine_id], slot.url == urls[slot.engine_id]
                if problem is None and same and slot.state == EngineState.AWAITING_WEIGHTS:
                    slot.version = version
                    slot.lifecycle.to(EngineState.ACTIVE, f"verified at version {version!r} ({source.name})")
                    verified.append(slot.engine_id)
                elif problem is not None:
                    log.warning("engine %d: restore from %s failed: %s", slot.engine_id, source.name, problem)
                    if same and not died and remember:  # this source's fault: not tried again at this version
                        self.failed_restores.add((source.name, version, slot.url))
        return verified, died

    def _give_up(self, batch: list[EngineSlot], urls: dict[int, str], why: str) -> None:
        """A restore past its deadline: the engines that do not answer /health are hung, so killed
        (INACTIVE); the others keep waiting for a restore or the next push."""
        ids = [s.engine_id for s in batch]
        answers = self.pool.on_all("health", ids, self.rollout.probe_timeout_s)
        for slot, ok in zip(batch, answers):
            if not ok:
                self._mark_dead(slot, f"{why}; /health did not answer", url=urls[slot.engine_id], kill=True)
        log.warning("%s: engines %s", why, ids)
