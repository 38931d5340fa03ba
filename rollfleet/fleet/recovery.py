"""Recovery of dead engines, all under one lock: a death watch, health probes, restarts (also in the
background) and restores (rollfleet.fleet.restore holds the sources).

Ordering, stated once:
- Detection marks an engine INACTIVE (death watch: its process exited, seen at once; probes of every
  ACTIVE or AWAITING_WEIGHTS engine, so also of one being restored: `probe_failures` consecutive
  /health probes slower than `probe_timeout_s`, then the process is killed so the restart starts
  clean). Only an engine whose url is still the one watched changes: an engine being restarted on
  purpose is RECOVERING and stays so.
- One restart at a time (`restart_inactive`, from the caller or the background thread): INACTIVE ->
  RECOVERING -> new process with the transport's restart load format -> AWAITING_WEIGHTS (no
  traffic; the engine itself refuses generate). Then every AWAITING_WEIGHTS engine (restarted, or
  left by a push that failed part-way) is restored: the sources in order (a peer engine at the
  fleet's version, a checkpoint of it, in a LoRA run the adapter of it, the next push), each engine verified on
  its own and ACTIVE once verified, whatever happens to the others. A source that fails an engine
  while no engine of its restore died is not tried again for that engine at that version; with no
  source left the engine waits for the trainer's next push.
- Every call of a restart is bounded: process starts by `startup_timeout_s`, restores by
  `restore_timeout_s`, after which the engines that do not answer /health are killed (INACTIVE) and
  the others keep waiting. No call blocks while the lock is held.
- `paused()` (rollfleet.fleet.restart_gate): a colocated trainer's turn waits for a restart under
  way (so at most its timeouts) and keeps the background thread from starting one (it holds the
  GPUs); a push waits only for a restore (a push never overlaps a restore) and runs beside engines
  starting, so a slow start (an SGLang server's) does not hold up the trainer. A background restore
  that meets a push is skipped and runs when the push ends.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

import ray

from rollfleet.fleet import standby
from rollfleet.fleet.lifecycle import FAILED, EngineSlot, EngineState
from rollfleet.fleet.peer_restore import PeerRestore
from rollfleet.fleet.restart_gate import RestartGate
from rollfleet.fleet.restore import (
    AdapterRestore,
    CheckpointRestore,
    RestoreError,
    RestoreSource,
    WaitForPush,
    run_before,
    verify_each,
)
from rollfleet.weights.transports.base import transport_class
from rollfleet.wire.client import UnsupportedEngine

if TYPE_CHECKING:
    from rollfleet.fleet.fleet import Fleet

log = logging.getLogger("rollfleet.recovery")
STOP_TIMEOUT_S = 60.0  # a stop is SIGTERM, then SIGKILL after a grace: bounded well below this


class Recovery:
    def __init__(self, fleet: Fleet):
        self.fleet, self.rollout = fleet, fleet.rollout
        self._lock = threading.Condition()  # the one lock: every state change made here, and the restarts
        self._kick = threading.Event()  # an engine died, or a skipped restore may run: the restarter reacts now
        self.gate = RestartGate(self._lock, on_resume=self._kick.set)  # what may run beside a push
        self._checkpoints: dict[str, str] = {}  # version -> HF directory (insertion order)
        # in order; the first that is available for an engine is tried
        self.peer = PeerRestore(fleet)
        checkpoint = CheckpointRestore(fleet, self.checkpoint_for)
        self.sources: list[RestoreSource] = [self.peer, checkpoint, AdapterRestore(fleet), WaitForPush()]
        self.failed_restores: set[tuple[str, str, str]] = set()  # (source, version, engine url): not again
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
        self._kick.set()
        for thread in self._threads:
            thread.join(timeout=60)

    def to(self, slot: EngineSlot, state: EngineState, why: str) -> None:
        """A state change made outside this module (the fleet's pushes, sleep, wake), under the lock."""
        with self._lock:
            slot.lifecycle.to(state, why)

    def mark_dead(self, slot: EngineSlot, why: str, *, url: str | None = None, kill: bool = False) -> bool:
        """INACTIVE, unless it is already failed or (with `url`) has been restarted since; with `kill`
        its process is killed too (a hung one ignores a polite stop). Whether it was marked."""
        with self._lock:
            if slot.state in FAILED or (url is not None and slot.url != url):
                return False
            slot.lifecycle.to(EngineState.INACTIVE, why)
            self._kick.set()  # the restarter (or a standby) takes over now, not at the next probe interval
            if kill:
                slot.head.kill_engine.remote()  # not waited for: nothing blocks under the lock
            return True

    def mark_verified(self, slot: EngineSlot, url: str, version: str, why: str) -> bool:
        """ACTIVE at `version`, unless it failed or was restarted (its url is not `url`) while it was
        being checked: a verification never revives a dead engine. Whether it was marked."""
        with self._lock:
            if slot.state in FAILED or slot.url != url:
                return False
            slot.version = version
            slot.lifecycle.to(EngineState.ACTIVE, why)
            return True

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
        """Catch hung engines (alive but not answering), serving or being restored: `probe_failures`
        consecutive /health probes slower than `probe_timeout_s` mark it INACTIVE and kill its process."""
        failures: dict[str, int] = {}  # by url: a restarted engine starts from zero
        watched = (EngineState.ACTIVE, EngineState.AWAITING_WEIGHTS)
        while not self._closing.wait(self.rollout.probe_interval_s):
            slots = [(s, s.url) for s in self.fleet.slots if s.state in watched]
            answers = self.fleet.pool.on_all("health", [s.engine_id for s, _ in slots], self.rollout.probe_timeout_s)
            failures = {url: 0 if ok else failures.get(url, 0) + 1 for (_, url), ok in zip(slots, answers)}
            for slot, url in slots:
                if failures[url] >= self.rollout.probe_failures:
                    self.mark_dead(slot, f"{failures[url]} health probes failed", url=url, kill=True)
                    failures[url] = 0

    # ---- restarts -------------------------------------------------------------------------------
    def promote_standbys(self) -> list[EngineSlot]:
        """Give each dead serving engine's place to a standby that is up (rollfleet.fleet.standby);
        the promoted engines wait (AWAITING_WEIGHTS) for a restore or a push. `restart_inactive`
        does this itself; a caller that times the steps apart (the recovery benchmark) calls it."""
        with self._lock:
            self.gate.wait_idle()
            return standby.promote(self.fleet.slots)

    def _restart_in_background(self) -> None:
        while not self._closing.is_set():
            self._kick.wait(self.rollout.probe_interval_s)  # a death kicks it: a standby takes over at once
            self._kick.clear()
            if self._closing.is_set() or not self.rollout.auto_restart:
                continue
            try:
                self.restart_inactive(background=True)
            except Exception:  # noqa: BLE001 - logged; the next round (or the caller) tries again
                log.exception("background restart failed")

    def paused(self, starts: bool = True):
        """A block no restore overlaps, and (with `starts`, a colocated trainer's turn) no engine start
        either; a push (`starts=False`) runs beside an engine starting (rollfleet.fleet.restart_gate)."""
        return self.gate.paused(starts)

    def restart_wait_s(self, slot: EngineSlot) -> float:
        """Seconds before an INACTIVE engine's next restart try (rollout.restart_backoff_s)."""
        return slot.lifecycle.restart_wait_s(self.rollout.restart_backoff_s, self.rollout.restart_backoff_max_s)

    def restart_inactive(
        self, restore_from: str | None = None, *, restore: bool = True, background: bool = False, force: bool = False
    ) -> list[int]:
        """Restart every INACTIVE engine with the transport's restart load format (AWAITING_WEIGHTS:
        not ready, no traffic), then (with `restore`) restore every AWAITING_WEIGHTS engine to the
        fleet's version: from `restore_from` if given, else from the sources in order. A standby first
        takes each dead serving engine's place (rollfleet.fleet.standby) and is restored before any
        restart; the dead slot restarts as the standby. An engine whose earlier restarts did not bring
        it back waits out its backoff (`restart_wait_s`) unless `force`. Never raises
        for an engine's or a source's failure (they are logged, and in the engines' histories).
        Returns the restarted engine ids."""
        pulls = self.rollout.backend == "sglang" and self.peer.available_for_start()  # SGLang pulls at start
        with self._lock:
            self.gate.wait_idle()
            if not self.gate.may_begin(background, pulls):
                return []
            promoted = standby.promote(self.fleet.slots)
            inactive = [s for s in self.fleet.slots if s.state == EngineState.INACTIVE]
            slots = [s for s in inactive if force or not self.restart_wait_s(s)]
            if not slots and not (restore and self._restorable(self.fleet.version, restore_from)):
                return []
            self.gate.begin(restoring=pulls)
            for slot in slots:
                slot.lifecycle.to(EngineState.RECOVERING, "restart")
        try:
            if restore and promoted and self.gate.restoring(background):  # a standby serves before any restart
                self._restore(promoted, self._sources(restore_from))
                self.gate.starting(pulls)
            restarted = self._start_again(slots) if slots else []
            for slot in (s for s in slots if s.engine_id not in restarted):
                log.warning("engine %d: restart failed; next try in %.0f s", slot.engine_id, self.restart_wait_s(slot))
            if restore and self.gate.restoring(background):  # skipped beside a push: the next round
                self._restore(self._awaiting(), self._sources(restore_from))
            return restarted
        finally:
            with self._lock:
                for slot in slots:  # an error nobody expected: the engine is not left half-restarted
                    if slot.state == EngineState.RECOVERING:
                        slot.lifecycle.to(EngineState.INACTIVE, "restart failed: interrupted")
                self.gate.end()

    def _start_again(self, slots: list[EngineSlot]) -> list[int]:
        """Stop, then start each engine (in parallel across engines); a call that fails or outlives
        its timeout leaves its engine INACTIVE ("restart failed")."""
        spec = self.fleet.cfg.weight_sync
        load_format, standby_format = transport_class(spec).restart_load_format, standby.standby_format(spec)
        stops = [s.head.stop_engine.remote() for s in slots]
        stopped = [s for s, stop in zip(slots, stops) if self._wait(s, stop, STOP_TIMEOUT_S)]
        version = self.fleet.version
        seeds = self.peer.start_seeds(standby.in_rotation(stopped), version)  # SGLang pulls only at start
        formats = {s.engine_id: standby_format if s.standby else load_format for s in stopped}
        starts = [s.head.start_engine.remote(s.gpu_ids, formats[s.engine_id], seeds.get(s.engine_id)) for s in stopped]
        restarted = []
        for slot, start in zip(stopped, starts):
            info = self._wait(slot, start, STOP_TIMEOUT_S + self.rollout.startup_timeout_s)
            if info and self._speaks_known_protocol(slot, info["url"]):
                how = "a peer's" if slot.engine_id in seeds else formats[slot.engine_id]
                role = " as a standby" if slot.standby else ""
                self.to(slot, EngineState.AWAITING_WEIGHTS, f"restarted{role} with {how} weights")
                restarted.append(slot.engine_id)
        self.peer.started(seeds, [self.fleet.slots[e] for e in restarted], version)
        return restarted

    def _speaks_known_protocol(self, slot: EngineSlot, url: str) -> bool:
        """The restarted engine is reachable at `url` (Fleet.engine_started reads its protocol); an
        SGLang release the senders do not speak, or an engine that does not answer /get_server_info
        (it died just after its start), is stopped and left INACTIVE with the reason."""
        try:
            self.fleet.engine_started(slot, url)
            return True
        except Exception as exc:  # noqa: BLE001 - this engine's restart failed; the others go on
            why = str(exc) if isinstance(exc, UnsupportedEngine) else f"its /get_server_info failed: {exc!r:.200}"
            try:
                ray.get(slot.head.stop_engine.remote(), timeout=STOP_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - already gone: INACTIVE either way
                log.warning("engine %d: stopping it after a failed restart failed too", slot.engine_id)
            self.to(slot, EngineState.INACTIVE, f"restart failed: {why}")
            return False

    def _wait(self, slot: EngineSlot, call: ray.ObjectRef, timeout_s: float):
        """The call's answer (True for None); False, with the engine INACTIVE, if it failed or timed out."""
        try:
            answer = ray.get(call, timeout=timeout_s)
        except ray.exceptions.RayError as exc:  # GetTimeoutError included
            self.to(slot, EngineState.INACTIVE, f"restart failed: {exc!r:.300}")
            return False
        return True if answer is None else answer

    # ---- restores -------------------------------------------------------------------------------
    def _sources(self, directory: str | None) -> list[RestoreSource]:
        return self.sources if directory is None else [CheckpointRestore(self.fleet, lambda v: directory)]

    def _restorable(self, version: str, directory: str | None) -> bool:
        """Whether a source (other than waiting) may restore an AWAITING_WEIGHTS engine now."""
        sources = [s for s in self._sources(directory) if not isinstance(s, WaitForPush)]
        return any(self._may_try(source, version, slot) for source in sources for slot in self._awaiting())

    def _awaiting(self) -> list[EngineSlot]:
        """Serving engines waiting for weights (standbys wait for a place, not for weights)."""
        return [s for s in standby.in_rotation(self.fleet.slots) if s.state == EngineState.AWAITING_WEIGHTS]

    def _may_try(self, source: RestoreSource, version: str, slot: EngineSlot) -> bool:
        return (source.name, version, slot.url) not in self.failed_restores and source.available(version, slot)

    def restore(self, directory: str, version: str, engine_ids: list[int], *, fan_out: bool = False) -> None:
        """Load a checkpoint into some engines (out of rotation meanwhile) and verify each; never
        advances the fleet's version. Raises RestoreError naming the engines not verified."""
        slots = [self.fleet.slots[e] for e in engine_ids]
        with self._lock:
            self.gate.wait_idle()
            self.gate.begin(restoring=True)
            for slot in slots:
                if slot.state in (EngineState.ACTIVE, EngineState.SLEEPING):
                    slot.lifecycle.to(EngineState.AWAITING_WEIGHTS, f"restore of version {version!r}")
        try:
            source = CheckpointRestore(self.fleet, lambda v: directory, fan_out)
            left = self._restore(slots, [source], version, remember=False)
        finally:
            with self._lock:
                self.gate.end()
        if left:
            raise RestoreError(f"restore of version {version!r} from {directory} left engines {left} unverified")

    def _restore(
        self, slots: list[EngineSlot], sources: list[RestoreSource], version: str | None = None, *, remember=True
    ) -> list[int]:
        """Each source in turn for the engines it is available to, until every engine is verified;
        all under one deadline. The engines left unverified (still AWAITING_WEIGHTS, or INACTIVE)."""
        version = self.fleet.version if version is None else version
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
            return None if report is None else verify_each(self.fleet, report, ids)

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
        answers = self.fleet.pool.on_all("health", ids, self.rollout.probe_timeout_s)
        for slot, ok in zip(batch, answers):
            if not ok:
                self.mark_dead(slot, f"{why}; /health did not answer", url=urls[slot.engine_id], kill=True)
        log.warning("%s: engines %s", why, ids)

    # ---- checkpoints ----------------------------------------------------------------------------
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
            if any(self.fleet.slots[e].lifecycle.failed_since(mark) for e, mark in marks.items()):
                return True
            if time.monotonic() >= deadline:
                return False
            self._closing.wait(0.05)
