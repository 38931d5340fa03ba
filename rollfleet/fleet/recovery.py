"""Recovery of dead engines, all under one lock: restarts (also in the background) of the engines
its detection marked dead (rollfleet.fleet.death_watch: the death watch and health probes), then
restores of the engines waiting for weights (rollfleet.fleet.restorer runs the sources of
rollfleet.fleet.restore). Recovery holds the lock, the restart gate and the registered checkpoints,
and makes every state change of the fleet's engines (`to`, `mark_dead`, `mark_verified`).

Ordering, stated once (detection's and a restore's own in their modules):
- One restart at a time (`restart_inactive`, from the caller or the background thread): INACTIVE ->
  RECOVERING -> new process with the transport's restart load format -> AWAITING_WEIGHTS (no
  traffic; the engine itself refuses generate). Then every AWAITING_WEIGHTS engine (restarted, or
  left by a push that failed part-way) is restored (rollfleet.fleet.restorer: the sources in order,
  each engine verified on its own and ACTIVE once verified, whatever happens to the others).
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
from collections.abc import Callable

import ray

from rollfleet.config import RunConfig
from rollfleet.fleet import standby
from rollfleet.fleet.death_watch import DeathWatch
from rollfleet.fleet.engine_protocols import check_engine_protocols
from rollfleet.fleet.lifecycle import FAILED, EngineSlot, EngineState
from rollfleet.fleet.peer_restore import PeerRestore
from rollfleet.fleet.restart_gate import RestartGate
from rollfleet.fleet.restore import AdapterRestore, CheckpointRestore, RestoreError, RestoreSource, WaitForPush
from rollfleet.fleet.restorer import Restorer
from rollfleet.fleet.weight_sends import WeightSends
from rollfleet.weights.transports.base import transport_class
from rollfleet.wire.client import UnsupportedEngine
from rollfleet.wire.pool import EnginePool

log = logging.getLogger("rollfleet.recovery")
STOP_TIMEOUT_S = 60.0  # a stop is SIGTERM, then SIGKILL after a grace: bounded well below this


class Recovery:
    def __init__(
        self,
        cfg: RunConfig,
        slots: list[EngineSlot],
        pool: EnginePool,
        sends: WeightSends,
        fleet_version: Callable[[], str],
    ):
        """The fleet's slots and pool, the sends its restore sources use, and `fleet_version()`: the
        version restores bring engines to (read each time: only the fleet's verified push advances it)."""
        self.cfg, self.rollout, self.slots, self.pool, self.sends = cfg, cfg.rollout, slots, pool, sends
        self.fleet_version = fleet_version
        self._lock = threading.Condition()  # the one lock: every state change made here, and the restarts
        self._kick = threading.Event()  # an engine died, or a skipped restore may run: the restarter reacts now
        self.gate = RestartGate(self._lock, on_resume=self._kick.set)  # what may run beside a push
        self._checkpoints: dict[str, str] = {}  # version -> HF directory (insertion order)
        # in order; the first that is available for an engine is tried
        self.peer = PeerRestore(cfg, slots, pool)
        checkpoint = CheckpointRestore(sends, self.checkpoint_for)
        self.sources: list[RestoreSource] = [self.peer, checkpoint, AdapterRestore(sends), WaitForPush()]
        self.restorer = Restorer(cfg, slots, pool, self._lock, self.mark_dead)
        self._closing = threading.Event()
        self.watch = DeathWatch(slots, pool, self.rollout, self.mark_dead, self._closing)
        restarter = threading.Thread(target=self._restart_in_background, name="rollfleet-restarter", daemon=True)
        self._threads = [*self.watch.threads, restarter]
        for thread in self._threads:
            thread.start()

    @property
    def failed_restores(self) -> set[tuple[str, str, str]]:
        """(source, version, engine url) of the restores not to try again (rollfleet.fleet.restorer)."""
        return self.restorer.failed_restores

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

    # ---- restarts -------------------------------------------------------------------------------
    def promote_standbys(self) -> list[EngineSlot]:
        """Give each dead serving engine's place to a standby that is up (rollfleet.fleet.standby);
        the promoted engines wait (AWAITING_WEIGHTS) for a restore or a push. `restart_inactive`
        does this itself; a caller that times the steps apart (the recovery benchmark) calls it."""
        with self._lock:
            self.gate.wait_idle()
            return standby.promote(self.slots)

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
            promoted = standby.promote(self.slots)
            inactive = [s for s in self.slots if s.state == EngineState.INACTIVE]
            slots = [s for s in inactive if force or not self.restart_wait_s(s)]
            if not slots and not (
                restore and self.restorer.restorable(self._sources(restore_from), self.fleet_version())
            ):
                return []
            self.gate.begin(restoring=pulls)
            for slot in slots:
                slot.lifecycle.to(EngineState.RECOVERING, "restart")
        try:
            if restore and promoted and self.gate.restoring(background):  # a standby serves before any restart
                self.restorer.restore(promoted, self._sources(restore_from), self.fleet_version())
                self.gate.starting(pulls)
            restarted = self._start_again(slots) if slots else []
            for slot in (s for s in slots if s.engine_id not in restarted):
                log.warning("engine %d: restart failed; next try in %.0f s", slot.engine_id, self.restart_wait_s(slot))
            if restore and self.gate.restoring(background):  # skipped beside a push: the next round
                self.restorer.restore(self.restorer.awaiting(), self._sources(restore_from), self.fleet_version())
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
        spec = self.cfg.weight_sync
        load_format, standby_format = transport_class(spec).restart_load_format, standby.standby_format(spec)
        stops = [s.head.stop_engine.remote() for s in slots]
        stopped = [s for s, stop in zip(slots, stops) if self._wait(s, stop, STOP_TIMEOUT_S)]
        version = self.fleet_version()
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
        self.peer.started(seeds, [self.slots[e] for e in restarted], version)
        return restarted

    def _speaks_known_protocol(self, slot: EngineSlot, url: str) -> bool:
        """The restarted engine answers at `url`, holds no verified weights and speaks a known protocol
        (its /get_server_info read once, rollfleet.fleet.engine_protocols); an SGLang release the
        senders do not speak, or an engine that does not answer /get_server_info (it died just after
        its start, or hangs: it must answer within the probes' budget, since no probe watches an engine
        while it is RECOVERING and this runs under the restart), is stopped and left INACTIVE with the reason."""
        try:
            slot.url, slot.version, slot.dtype = url, "", None
            self.pool.set_url(slot.engine_id, url)
            budget = self.rollout.probe_timeout_s * self.rollout.probe_failures
            check_engine_protocols(self.pool, [slot.engine_id], timeout_s=budget)
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
        return self.sources if directory is None else [CheckpointRestore(self.sends, lambda v: directory)]

    def restore(self, directory: str, version: str, engine_ids: list[int], *, fan_out: bool = False) -> None:
        """Load a checkpoint into some engines (out of rotation meanwhile) and verify each; never
        advances the fleet's version. Raises RestoreError naming the engines not verified."""
        slots = [self.slots[e] for e in engine_ids]
        with self._lock:
            self.gate.wait_idle()
            self.gate.begin(restoring=True)
            for slot in slots:
                if slot.state in (EngineState.ACTIVE, EngineState.SLEEPING):
                    slot.lifecycle.to(EngineState.AWAITING_WEIGHTS, f"restore of version {version!r}")
        try:
            source = CheckpointRestore(self.sends, lambda v: directory, fan_out)
            left = self.restorer.restore(slots, [source], version, remember=False)
        finally:
            with self._lock:
                self.gate.end()
        if left:
            raise RestoreError(f"restore of version {version!r} from {directory} left engines {left} unverified")

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
        spec = self.cfg.weight_sync
        return registered or transport_class(spec).restore_checkpoint(spec, version)
