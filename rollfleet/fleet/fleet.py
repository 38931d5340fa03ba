"""Fleet: the one object callers drive the rollout engines through, on top of fleet/'s helpers (none
imports this module): it routes generate requests, releases and resumes the engines' memory, and
pushes weights into them and verifies them. Starting the engines is rollfleet.fleet.startup's job,
recovery rollfleet.fleet.recovery's, a colocated trainer's turn rollfleet.fleet.colocation's.

fleet = Fleet.from_config(cfg)
samples = fleet.generate(prompts, n=8)
with fleet.trainer_turn(trainers):      # colocated: engines release memory, trainers take the GPUs
    trainers.train_step(batch)
    fleet.sync_from(trainers, "1")      # push, verify, retry after an engine died
fleet.shutdown()

Ordering of a push, stated once: every engine targeted by a push is out of rotation from the moment
the push fails (AWAITING_WEIGHTS: no generate traffic) until a later push or restore verifies it;
after a send returns, each engine is verified (every tensor's fingerprint and the version, or the
version alone on SGLang) before it serves the new version, and an engine that fails verification is
marked INACTIVE. Only a verified trainer push advances the fleet's version; generate routes only to
ACTIVE engines at that version.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from functools import partial

from rich.progress import Progress
from transformers import AutoTokenizer

from rollfleet.config import RunConfig
from rollfleet.fleet import colocation, startup
from rollfleet.fleet.engine_protocols import check_engine_protocols
from rollfleet.fleet.lifecycle import EngineSlot, EngineState
from rollfleet.fleet.recovery import Recovery
from rollfleet.fleet.router import Router
from rollfleet.fleet.sampling_seeds import seeded_payload
from rollfleet.fleet.seams import Trainers
from rollfleet.fleet.weight_sends import WeightSends
from rollfleet.sample import Sample
from rollfleet.weights.source import WeightSource
from rollfleet.weights.transports import EngineTarget, SyncReport
from rollfleet.weights.transports.base import transport_class
from rollfleet.weights.verify import find_unverified
from rollfleet.wire.pool import EnginePool

log = logging.getLogger("rollfleet.fleet")


class WeightSyncError(RuntimeError):
    pass


class Fleet:
    def __init__(self, cfg: RunConfig, placement_group, workers: list, slots: list[EngineSlot], tokenizer):
        self.cfg, self.rollout = cfg, cfg.rollout
        self.placement_group, self.workers, self.slots = placement_group, workers, slots
        self.tokenizer = tokenizer
        self.version = "default"  # the weight version every ACTIVE engine holds (verified)
        self.lora_name: str | None = None  # the adapter generate asks for, once a LoRA sync verified it
        self._event_marks: dict[int, int] = {}
        self._weights_released = False
        self.pool = EnginePool.for_urls(
            {s.engine_id: s.url for s in slots}, **self.rollout.keys, timeout=self.rollout.request_timeout_s
        )
        self.sends = WeightSends(cfg, slots, self.pool)  # targets, sends, a checkpoint's fingerprints
        self.recovery = Recovery(cfg, slots, self.pool, self.sends, fleet_version=lambda: self.version)
        self.router = Router(slots, self.pool, wait_s=self.rollout.recovery_wait_s, on_dead=self.recovery.mark_dead)

    # ---- building -----------------------------------------------------------------------------
    @classmethod
    def from_config(cls, cfg: RunConfig, *, load_format: str = "auto", on_placement: Callable | None = None) -> Fleet:
        """Workers on a placement group, engines started and waited for; `on_placement(group)` runs once
        the group exists, before the engines start (the loop creates its trainers there;
        rollfleet.fleet.startup)."""
        group, workers, slots = startup.place_and_start(cfg, load_format, on_placement)
        fleet = cls(cfg, group, workers, slots, AutoTokenizer.from_pretrained(cfg.rollout.model_path))
        check_engine_protocols(fleet.pool, [s.engine_id for s in slots], on_refusal=fleet.shutdown)
        return fleet

    def shutdown(self) -> None:
        self.recovery.close()
        self.pool.close()
        startup.teardown(self.workers, self.placement_group)

    # ---- recovery (rollfleet.fleet.recovery) ------------------------------------------------------
    def restart_inactive(
        self, restore_from: str | None = None, *, restore: bool = True, force: bool = False
    ) -> list[int]:
        return self.recovery.restart_inactive(restore_from, restore=restore, force=force)

    def restore(self, directory: str, version: str, engine_ids: list[int], *, fan_out: bool = False) -> None:
        self.recovery.restore(directory, version, engine_ids, fan_out=fan_out)

    def register_checkpoint(self, version: str, directory: str) -> None:
        self.recovery.register_checkpoint(version, directory)

    def checkpoint_for(self, version: str) -> str | None:
        return self.recovery.checkpoint_for(version)

    def take_events(self) -> list[dict]:
        """Lifecycle transitions of every engine since the last call (for the run's metrics)."""
        events = []
        for slot in self.slots:
            for t in slot.lifecycle.since(self._event_marks.get(slot.engine_id, 0)):
                events.append({"engine_id": slot.engine_id, "time": t.time, "from": t.old, "to": t.new, "why": t.why})
            self._event_marks[slot.engine_id] = slot.lifecycle.mark()
        return sorted(events, key=lambda e: e["time"])

    # ---- generation ---------------------------------------------------------------------------
    def generate(
        self,
        prompts: Sequence[str] | Sequence[list[int]],
        *,
        n: int | None = None,
        sampling: dict | None = None,
        progress: bool = False,
        on_group: Callable[[list[Sample]], None] | None = None,
        routed_experts: bool = False,
        seeds: Sequence[int] | None = None,
    ) -> list[Sample]:
        """n samples per prompt, in input order (prompt 0's samples, then prompt 1's, ...); with
        `routed_experts` each carries the experts its engine chose (the fleet started with routing replay).
        `on_group(samples)` runs as each prompt's samples arrive (e.g. to start its rewards), on the
        engine pool's thread: it must not block. `seeds` (one per prompt): each prompt's samples are
        drawn from its seed (rollfleet.fleet.sampling_seeds), whichever engine serves them."""
        params = {**self.rollout.sampling.model_dump(), **(sampling or {})}
        if n is not None:
            params["n"] = n
        prompt_ids = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        if seeds is not None and len(seeds) != len(prompt_ids):
            raise ValueError(f"{len(seeds)} seeds for {len(prompt_ids)} prompts: give one seed per prompt, or None")
        request = {"sampling_params": params, "return_logprob": True}
        if self.rollout.backend == "embedded":  # the logprobs as one list per sample (wire/protocol.py)
            request["return_logprob_values"] = True
        if routed_experts:
            request["return_routed_experts"] = True
        if self.lora_name is not None:  # a LoRA run: the adapter the last verified sync loaded
            request["lora_path"] = self.lora_name
        payloads = [{"input_ids": ids, **request} for ids in prompt_ids]
        if seeds is not None:
            each = self.rollout.seeds_each_sample
            payloads = [seeded_payload(p, seed, each_sample=each) for p, seed in zip(payloads, seeds)]
        return self.pool.run(self._generate(prompt_ids, payloads, self.version, progress, on_group))

    async def _generate(self, prompt_ids, payloads, version, progress, on_group) -> list[Sample]:
        with Progress(disable=not progress, transient=True) as bar:
            task = bar.add_task("generate", total=len(prompt_ids))

            async def one(index: int) -> list[Sample]:
                outs, engine_id = await self.router.generate(payloads[index], version)
                bar.advance(task)
                group = [Sample.from_answer(index, k, prompt_ids[index], out, engine_id) for k, out in enumerate(outs)]
                if on_group is not None:
                    on_group(group)
                return group

            groups = await asyncio.gather(*(one(i) for i in range(len(prompt_ids))))
        return [sample for group in groups for sample in group]

    # ---- memory ---------------------------------------------------------------------------------
    def sleep(self, tags: list[str] | None = None) -> list[dict]:
        """Release memory on every running engine (SGLang: released weights must be pushed again).
        Per engine, its memory per rank before and after (`{"memory": [{"before", "after"}]}`, read
        from the embedded engine's /rollfleet/memory: a release answers null, as SGLang's does; {}
        for SGLang, which reports no figures)."""
        running, embedded = self.running(), self.rollout.backend == "embedded"
        before = self.pool.on_all("memory", running) if embedded else []
        self.pool.on_all("release_memory_occupation", running, tags)
        after = self.pool.on_all("memory", running) if embedded else []
        answers = [{"memory": [{"before": b, "after": a} for b, a in zip(*pair)]} for pair in zip(before, after)]
        for slot in self.slots:
            if slot.state == EngineState.ACTIVE:
                self.recovery.to(slot, EngineState.SLEEPING, f"released {tags or 'all'}")
            if slot.is_running and (tags is None or "weights" in tags):
                slot.version = ""  # released weights are gone: no version until a push is verified
        self._weights_released = self._weights_released or tags is None or "weights" in tags
        return answers or [{} for _ in running]

    def wake(self, tags: list[str] | None = None) -> None:
        """Resume memory; an engine whose weights were released waits for a push (AWAITING_WEIGHTS)."""
        self.pool.on_all("resume_memory_occupation", self.running(), tags)
        for slot in self.slots:
            if slot.state == EngineState.SLEEPING:
                holds_weights = slot.version == self.version
                state = EngineState.ACTIVE if holds_weights else EngineState.AWAITING_WEIGHTS
                self.recovery.to(slot, state, f"resumed {tags or 'all'}")
        if tags is None or "weights" in tags:
            self._weights_released = False

    def trainer_turn(self, trainers: Trainers, *, timed: Callable[[str], object] | None = None, moves=None):
        """Colocated: engines release the GPUs for the trainer's turn and take them back after, the
        moves' bytes and seconds recorded in `moves` (rollfleet.fleet.colocation); nothing in
        disaggregated placement."""
        return colocation.trainer_turn(self, trainers, timed, moves)

    def running(self, engine_ids: list[int] | None = None) -> list[int]:
        """Serving engines that are up (standbys left out: they take no pushes, sleep or wake)."""
        return self.sends.running(engine_ids)

    # ---- weight sync ----------------------------------------------------------------------------
    def weight_targets(self, engine_ids: list[int] | None = None) -> list[EngineTarget]:
        """The live engines a sync goes to (rollfleet.fleet.weight_sends)."""
        return self.sends.weight_targets(engine_ids)

    def sync_weights(
        self,
        source: WeightSource,
        version: str,
        *,
        engine_ids: list[int] | None = None,
        transport=None,
        advance: bool = True,
        **transport_options,
    ) -> SyncReport:
        """Push `source` (tensors in this process) to the engines over `transport` (default: the
        configured weight_sync), then verify every engine."""
        spec = transport or self.cfg.weight_sync
        send = partial(self.sends.send_weights, source, version, spec=spec, **transport_options)  # send(targets)
        return self._push(send, version, engine_ids, advance=advance)

    def sync_from(self, trainers: Trainers, version: str, attempts: int = 3) -> SyncReport:
        """The trainer's push of `version` to every running engine, verified. An engine that dies during
        the push is restarted and the push made again (engines that took it verify again: idempotent)."""
        spec = self.cfg.weight_sync
        options = transport_class(spec).sender_options(self.rollout.model_path)
        for attempt in range(attempts):
            marks = {s.engine_id: s.lifecycle.mark() for s in self.slots if s.is_running}  # not those restarting
            try:
                return self._push(lambda targets: trainers.push_weights(spec, targets, version, **options), version)
            except Exception:
                if attempt == attempts - 1 or not self.recovery.watch.wait_for_failure(marks):
                    raise
                self.restart_inactive(restore=False)  # they take this very push
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _push(self, send, version: str, engine_ids: list[int] | None = None, *, advance: bool = True) -> SyncReport:
        """Every push's one path: engines whose weights were released resume them, the send goes to
        the targets, and they are verified. A send that raises takes every target out of rotation."""
        with self.recovery.paused(starts=False):  # a push never overlaps a restore
            began = time.perf_counter()
            if self._weights_released:
                self.wake(["weights"])  # colocated: the engines allocate their weights again
            woke, began = time.perf_counter() - began, time.perf_counter()
            targets = self.weight_targets(engine_ids)
            try:
                report = send(targets)
            except BaseException as exc:
                why = f"push of version {version!r} failed: {exc!r:.300}"
                for slot in (self.slots[t.engine_id] for t in targets if self.slots[t.engine_id].is_running):
                    slot.version = ""
                    self.recovery.to(slot, EngineState.AWAITING_WEIGHTS, why)
                raise
            sent = time.perf_counter()  # send_call: the sender's seconds plus the calls to the trainer ranks
            self.verify(report, advance=advance)
            report.phases.update(wake_weights=woke, send_call=sent - began, verify=time.perf_counter() - sent)
            return report

    def update_weights_from_disk(
        self, path: str, weight_version: str, engine_ids: list[int] | None = None, *, advance: bool = True
    ) -> None:
        """Load a HF directory into engines, then verify them against the files' own fingerprints."""
        with self.recovery.paused(starts=False):  # a push never overlaps a restore
            self.pool.on_all("update_weights_from_disk", self.running(engine_ids), path, weight_version=weight_version)
            self.verify_checkpoint(path, weight_version, engine_ids, advance=advance)

    def verify_checkpoint(
        self, path: str, weight_version: str, engine_ids: list[int] | None = None, *, advance: bool = True
    ) -> None:
        """Verify engines against fingerprints computed here from the checkpoint's files."""
        self.verify(self.expected_from_checkpoint(path, weight_version, engine_ids), advance=advance)

    def expected_from_checkpoint(self, path: str, weight_version: str, engine_ids: list[int] | None = None):
        """What engines holding checkpoint `path` at `weight_version` must report (rollfleet.fleet.weight_sends)."""
        return self.sends.expected_from_checkpoint(path, weight_version, engine_ids)

    def verify(self, report: SyncReport, *, advance: bool = True) -> None:
        """Compare each engine's fingerprints and version with what was sent; an engine that differs is
        marked failed (no more traffic) and WeightSyncError names it. With `advance` (a trainer's push)
        the fleet's version becomes the report's; a restore does not advance it: the restarter may finish
        restoring v after the trainer pushed v+1, and going back to v would route to the stale engine."""
        clients = {e: self.pool.client(e) for e in report.engine_ids}
        urls = {e: self.slots[e].url for e in report.engine_ids}
        failed = self.pool.run(find_unverified(report, clients, self.cfg.verify_mode))
        for engine_id in report.engine_ids:
            slot, why = self.slots[engine_id], f"verified at version {report.version!r}"
            if engine_id in failed:
                slot.version = ""
                self.recovery.to(slot, EngineState.INACTIVE, f"weights not verified: {failed[engine_id]}")
            elif not self.recovery.mark_verified(slot, urls[engine_id], report.version, why):
                failed[engine_id] = f"it failed while it was verified (now {slot.state.value})"
        report.verified = [e for e in report.engine_ids if e not in failed]
        if advance and report.verified:
            self.version = report.version
            if report.lora_name is not None:
                self.lora_name = report.lora_name
        if failed:
            detail = "; ".join(f"engine {e}: {problem}" for e, problem in sorted(failed.items()))
            raise WeightSyncError(
                f"weight sync to version {report.version!r} not verified, engines marked failed: {detail}"
            )
