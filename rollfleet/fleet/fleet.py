"""Fleet: lays rollout engines out over GPUs with Ray, starts them, and routes generate requests.

fleet = Fleet.from_config(cfg)
samples = fleet.generate(prompts, n=8)
fleet.sleep(); ...train...; fleet.wake()
fleet.shutdown()
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path

import httpx
import ray
from rich.progress import Progress
from transformers import AutoConfig, AutoTokenizer

from rollfleet.config import RunConfig, TensorSync
from rollfleet.engine.launch import lora_server_args
from rollfleet.fleet.health import EngineState
from rollfleet.fleet.placement import check_engines_on_one_node, create_placement_group, worker_options
from rollfleet.fleet.router import EngineSlot, Router
from rollfleet.fleet.workers import RemoteRolloutWorker
from rollfleet.layout import build_rank_infos, engine_rank_groups, validate_layout
from rollfleet.sample import Sample
from rollfleet.weights.checkpoint import CheckpointSource
from rollfleet.weights.source import WeightSource
from rollfleet.weights.transports import EngineTarget, SyncReport, make_transport
from rollfleet.weights.transports.disk import version_dir
from rollfleet.weights.transports.lora import LoraSyncReport
from rollfleet.weights.verify import find_unverified
from rollfleet.wire.buckets import dtype_from_name
from rollfleet.wire.client import EngineClient
from rollfleet.wire.fingerprint import fingerprints
from rollfleet.wire.hf_files import read_checkpoint

log = logging.getLogger("rollfleet.fleet")


class WeightSyncError(RuntimeError):
    pass


def ensure_ray(cfg: RunConfig) -> None:
    if ray.is_initialized():
        return
    ray.init(
        address=cfg.ray.address,
        num_cpus=cfg.ray.num_cpus,
        num_gpus=cfg.ray.num_gpus,
        _temp_dir=cfg.ray.temp_dir,
        include_dashboard=False,
        log_to_driver=False,
    )


class Fleet:
    def __init__(self, cfg: RunConfig, placement_group, workers: list, slots: list[EngineSlot], tokenizer):
        self.cfg, self.rollout = cfg, cfg.rollout
        self.placement_group, self.workers, self.slots = placement_group, workers, slots
        self.tokenizer = tokenizer
        self.version = "default"  # the weight version every ACTIVE engine holds (verified)
        self.lora_name: str | None = None  # the adapter generate asks for, once a LoRA sync verified it
        self._events_seen: dict[int, int] = {}
        self._recovery_checkpoints: dict[str, str] = {}  # version -> HF directory (insertion order)
        self._closing = threading.Event()
        self._watcher = threading.Thread(target=self._watch_exits, name="rollfleet-death-watch", daemon=True)
        self._watcher.start()
        self._prober = threading.Thread(target=self._probe, name="rollfleet-health-probe", daemon=True)
        self._prober.start()
        self._restart_lock = threading.Lock()
        self._restarts_allowed = threading.Event()
        self._restarts_allowed.set()
        self._restarter = threading.Thread(target=self._restart_in_background, name="rollfleet-restarter", daemon=True)
        self._restarter.start()

    # ---- building -----------------------------------------------------------------------------
    @classmethod
    def from_config(cls, cfg: RunConfig, *, load_format: str = "auto") -> Fleet:
        rollout = cfg.rollout
        validate_layout(
            rollout.world_size,
            rollout.tp_size,
            rollout.pp_size,
            rollout.ep_size,
            model_config=AutoConfig.from_pretrained(rollout.model_path),
            train_sequence_parallel_size=cfg.trainer.sequence_parallel_size,
            colocated=rollout.placement == "colocated",
            allow_kv_head_replication=rollout.backend == "sglang",
        )
        ensure_ray(cfg)
        ranks = build_rank_infos(rollout.num_engines, rollout.pp_size, rollout.tp_size, rollout.ep_size)
        group = create_placement_group(rollout)
        log_dir = str(Path(rollout.log_dir).resolve())
        # engines of a LoRA run serve the adapter the trainer sends (--enable-lora ...)
        rollout = rollout.model_copy(
            update={"server_extras": [*lora_server_args(cfg.weight_sync), *rollout.server_extras]}
        )
        workers = [
            RemoteRolloutWorker.options(**worker_options(group, r.rank, rollout)).remote(r, rollout, log_dir)
            for r in ranks
        ]
        try:
            placements = ray.get([w.placement.remote() for w in workers])
            check_engines_on_one_node(ranks, {p["rank"]: p["node_id"] for p in placements})
            slots = cls._start_engines(ranks, workers, placements, load_format)
            for slot in slots:
                slot.lifecycle.to(
                    EngineState.AWAITING_WEIGHTS if load_format == "dummy" else EngineState.ACTIVE,
                    f"started ({load_format} weights)",
                )
        except BaseException:
            cls._teardown(workers, group)
            raise
        tokenizer = AutoTokenizer.from_pretrained(rollout.model_path)
        return cls(cfg, group, workers, slots, tokenizer)

    @staticmethod
    def _start_engines(ranks, workers, placements, load_format) -> list[EngineSlot]:
        slots, starts = [], []
        for engine_id, members in sorted(engine_rank_groups(ranks).items()):
            gpu_ids = [g for m in members for g in placements[m.rank]["gpu_ids"]]
            head = workers[members[0].rank]
            slots.append(EngineSlot(engine_id, "", head, gpu_ids=gpu_ids))
            starts.append(head.start_engine.remote(gpu_ids, load_format))
        for slot, info in zip(slots, ray.get(starts)):  # engines start in parallel; a failure raises with its log
            slot.url = info["url"]
        return slots

    @staticmethod
    def _teardown(workers, group) -> None:
        ray.get([w.stop_engine.remote() for w in workers], timeout=60)
        for worker in workers:
            ray.kill(worker)
        ray.util.remove_placement_group(group)

    def shutdown(self) -> None:
        self._closing.set()
        self._watcher.join(timeout=5)
        self._prober.join(timeout=5)
        self._restarter.join(timeout=60)
        self._teardown(self.workers, self.placement_group)

    # ---- detection and recovery ------------------------------------------------------------------
    def _watch_exits(self) -> None:
        """Notice an engine process exit at once: one blocking wait per running engine on its head
        worker; when it returns, the engine is INACTIVE (unless it is being restarted on purpose)."""
        waits: dict[int, tuple[ray.ObjectRef, str]] = {}
        while not self._closing.is_set():
            for slot in self.slots:
                if slot.is_running and slot.engine_id not in waits:
                    waits[slot.engine_id] = (slot.head.wait_engine_exit.remote(), slot.url)
            if not waits:
                time.sleep(0.1)
                continue
            ready, _ = ray.wait([ref for ref, _ in waits.values()], num_returns=1, timeout=0.2)
            for engine_id, (ref, url) in list(waits.items()):
                if ref not in ready:
                    continue
                del waits[engine_id]
                slot = self.slots[engine_id]
                if slot.url == url and slot.state not in (EngineState.INACTIVE, EngineState.RECOVERING):
                    try:
                        code = ray.get(ref)
                    except ray.exceptions.RayError as exc:  # the worker itself is gone (node loss)
                        code = repr(exc)
                    slot.lifecycle.to(EngineState.INACTIVE, f"engine process exited (code {code})")

    def _probe(self) -> None:
        """Catch hung engines (alive but not answering): `probe_failures` consecutive /health probes
        slower than `probe_timeout_s` mark an ACTIVE engine INACTIVE and stop its process."""
        failures: dict[int, int] = {}
        while not self._closing.wait(self.rollout.probe_interval_s):
            for slot in [s for s in self.slots if s.state == EngineState.ACTIVE]:
                headers = {"Authorization": f"Bearer {self.rollout.api_key}"} if self.rollout.api_key else {}
                try:
                    ok = (
                        httpx.get(
                            f"{slot.url}/health", headers=headers, timeout=self.rollout.probe_timeout_s
                        ).status_code
                        == 200
                    )
                except httpx.HTTPError:
                    ok = False
                failures[slot.engine_id] = 0 if ok else failures.get(slot.engine_id, 0) + 1
                if failures[slot.engine_id] >= self.rollout.probe_failures and slot.state == EngineState.ACTIVE:
                    slot.lifecycle.to(EngineState.INACTIVE, f"{failures[slot.engine_id]} health probes failed")
                    failures[slot.engine_id] = 0
                    slot.head.kill_engine.remote()  # a hung process is ended, so the restart starts clean

    def _restart_in_background(self) -> None:
        while not self._closing.wait(self.rollout.probe_interval_s):
            if (
                self.rollout.auto_restart
                and self._restarts_allowed.is_set()
                and any(s.state == EngineState.INACTIVE for s in self.slots)
            ):
                try:
                    self.restart_inactive()
                except Exception:  # noqa: BLE001 - logged; the next round (or the caller) tries again
                    log.exception("background restart failed")

    @contextmanager
    def restarts_paused(self):
        """No restart starts inside this block (colocated: while the trainer holds the GPUs)."""
        self._restarts_allowed.clear()
        with self._restart_lock:  # wait for a restart already under way
            pass
        try:
            yield
        finally:
            self._restarts_allowed.set()

    def restart_inactive(self, restore_from: str | None = None, *, restore: bool = True) -> list[int]:
        with self._restart_lock:
            return self._restart_inactive(restore_from, restore)

    def _restart_inactive(self, restore_from: str | None, restore: bool) -> list[int]:
        """Restart every INACTIVE engine with dummy weights (AWAITING_WEIGHTS: not ready, no traffic),
        then restore the fleet's current version from `restore_from` or the newest matching disk
        checkpoint, sent only to them, and verify; without a checkpoint they wait for the trainer's
        next sync. Returns the restarted engine ids."""
        slots = [s for s in self.slots if s.state == EngineState.INACTIVE]
        for slot in slots:
            slot.lifecycle.to(EngineState.RECOVERING, "restart")
        ray.get([s.head.stop_engine.remote() for s in slots])
        # a LoRA run never sends base weights: restarted engines load them from the model path
        load_format = "auto" if self.cfg.weight_sync.transport == "lora" else "dummy"
        starts = [s.head.start_engine.remote(s.gpu_ids, load_format) for s in slots]
        restarted = []
        for slot, start in zip(slots, starts):
            try:
                slot.url, slot.version = ray.get(start)["url"], ""
            except ray.exceptions.RayError as exc:
                slot.lifecycle.to(EngineState.INACTIVE, f"restart failed: {exc}")
                continue
            slot.lifecycle.to(EngineState.AWAITING_WEIGHTS, f"restarted with {load_format} weights")
            restarted.append(slot.engine_id)
        directory = restore_from or self.checkpoint_for(self.version)
        if restarted and directory and restore:
            self.restore(directory, self.version, restarted)
        return restarted

    def restore(self, directory: str, version: str, engine_ids: list[int], *, fan_out: bool | None = None) -> None:
        """Load a checkpoint into some engines and verify them. With several engines the files are
        read once here and the tensors fanned out over the tensor transport (shared memory on CPU,
        CUDA IPC on GPU; same node), instead of each engine reading the disk."""
        if fan_out if fan_out is not None else len(engine_ids) > 1:
            self.sync_weights(
                CheckpointSource(directory), version, engine_ids=engine_ids, transport=TensorSync(), advance=False
            )
        else:
            self.update_weights_from_disk(directory, version, engine_ids=engine_ids, advance=False)

    def take_events(self) -> list[dict]:
        """Lifecycle transitions of every engine since the last call (for the run's metrics)."""
        events = []
        for slot in self.slots:
            seen = self._events_seen.get(slot.engine_id, 0)
            for at, old, new, why in slot.lifecycle.history[seen:]:
                events.append({"engine_id": slot.engine_id, "time": at, "from": old, "to": new, "why": why})
            self._events_seen[slot.engine_id] = len(slot.lifecycle.history)
        return sorted(events, key=lambda e: e["time"])

    def register_checkpoint(self, version: str, directory: str) -> None:
        """A HF directory holding `version` (the trainer saves one for recovery); the newest two are kept."""
        self._recovery_checkpoints[version] = directory
        for old in list(self._recovery_checkpoints)[:-2]:
            del self._recovery_checkpoints[old]

    def checkpoint_for(self, version: str) -> str | None:
        """A checkpoint directory holding exactly `version`: registered by the trainer, or the disk
        sync's own directory; None when there is none (restarted engines then wait for a push)."""
        if version in self._recovery_checkpoints:
            return self._recovery_checkpoints[version]
        if self.cfg.weight_sync.transport != "disk":
            return None
        directory = version_dir(self.cfg.weight_sync.path, version)
        return str(directory.resolve()) if directory.is_dir() else None

    # ---- generation ---------------------------------------------------------------------------
    def generate(
        self,
        prompts: Sequence[str] | Sequence[list[int]],
        *,
        n: int | None = None,
        sampling: dict | None = None,
        progress: bool = False,
        on_group=None,
    ) -> list[Sample]:
        """n samples per prompt, in input order (prompt 0's samples, then prompt 1's, ...).
        `on_group(samples)` is called as each prompt's samples arrive (e.g. to start its rewards)."""
        return asyncio.run(self.agenerate(prompts, n=n, sampling=sampling, progress=progress, on_group=on_group))

    async def agenerate(
        self, prompts, *, n: int | None = None, sampling: dict | None = None, progress: bool = False, on_group=None
    ) -> list[Sample]:
        params = {**self.rollout.sampling.model_dump(), **(sampling or {})}
        if n is not None:
            params["n"] = n
        prompt_ids = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        request = {"sampling_params": params, "return_logprob": True}
        if self.lora_name is not None:  # a LoRA run: the adapter the last verified sync loaded
            request["lora_path"] = self.lora_name
        router = Router(
            self.slots,
            self.version,
            api_key=self.rollout.api_key,
            timeout=self.rollout.request_timeout_s,
            wait_s=self.rollout.recovery_wait_s,
        )
        try:
            with Progress(disable=not progress, transient=True) as bar:
                task = bar.add_task("generate", total=len(prompt_ids))

                async def one(index: int) -> list[Sample]:
                    outs, engine_id = await router.generate({"input_ids": prompt_ids[index], **request})
                    bar.advance(task)
                    group = [_sample(index, k, prompt_ids[index], out, engine_id) for k, out in enumerate(outs)]
                    if on_group is not None:
                        on_group(group)
                    return group

                groups = await asyncio.gather(*(one(i) for i in range(len(prompt_ids))))
        finally:
            await router.close()
        self.last_retries = router.retries
        return [sample for group in groups for sample in group]

    # ---- fleet-wide verbs -----------------------------------------------------------------------
    def sleep(self, tags: list[str] | None = None) -> None:
        """Release memory on every running engine (SGLang: released weights must be pushed again)."""
        self._on_all("release_memory_occupation", tags)
        for slot in self.slots:
            if slot.state == EngineState.ACTIVE:
                slot.lifecycle.to(EngineState.SLEEPING, f"released {tags or 'all'}")
            if slot.is_running and (tags is None or "weights" in tags):
                slot.version = ""  # released weights are gone: no version until a push is verified

    def wake(self, tags: list[str] | None = None) -> None:
        """Resume memory; an engine whose weights were released waits for a push (AWAITING_WEIGHTS)."""
        self._on_all("resume_memory_occupation", tags)
        for slot in self.slots:
            if slot.state == EngineState.SLEEPING:
                holds_weights = slot.version == self.version
                slot.lifecycle.to(
                    EngineState.ACTIVE if holds_weights else EngineState.AWAITING_WEIGHTS, f"resumed {tags or 'all'}"
                )

    def update_weights_from_disk(
        self, path: str, weight_version: str, engine_ids: list[int] | None = None, *, advance: bool = True
    ) -> None:
        """Load a HF directory into engines, then verify them against the files' own fingerprints."""
        self._on_all("update_weights_from_disk", path, weight_version=weight_version, engine_ids=engine_ids)
        self.verify_checkpoint(path, weight_version, engine_ids, advance=advance)

    def verify_checkpoint(
        self, path: str, weight_version: str, engine_ids: list[int] | None = None, *, advance: bool = True
    ) -> None:
        """Verify engines against fingerprints computed here from the checkpoint's files."""
        targets = self.weight_targets(engine_ids)
        tensors = read_checkpoint(path) if self.cfg.verify_mode == "fingerprint" else {}  # version mode: no reads
        report = SyncReport(version=weight_version, transport="disk", engine_ids=[t.engine_id for t in targets])
        for target in targets:
            report.fingerprints[target.engine_id] = fingerprints(tensors.items(), target.dtype)
        self.verify(report, advance=advance)

    def _on_all(self, verb: str, *args, engine_ids: list[int] | None = None, **kwargs) -> list:
        """The same call on every live engine (or the live ones among engine_ids), concurrently."""
        targets = [s for s in self.slots if s.is_running and (engine_ids is None or s.engine_id in engine_ids)]

        async def go():
            async def call(slot):
                async with EngineClient(
                    slot.url, api_key=self.rollout.api_key, timeout=self.rollout.request_timeout_s
                ) as client:
                    return await getattr(client, verb)(*args, **kwargs)

            return await asyncio.gather(*(call(s) for s in targets))

        return asyncio.run(go())

    # ---- weight sync ----------------------------------------------------------------------------
    def weight_targets(self, engine_ids: list[int] | None = None) -> list[EngineTarget]:
        """The live engines a sync goes to; group ranks are numbered over the targeted engines only
        (all engines: engine i at 1 + i*tp*pp), so a sync to a subset forms a smaller group."""
        slots = [s for s in self.slots if s.is_running and (engine_ids is None or s.engine_id in engine_ids)]
        unknown = [s for s in slots if s.dtype is None]
        for slot, info in zip(unknown, self._on_all("get_model_info", engine_ids=[s.engine_id for s in unknown])):
            slot.dtype = info.get("dtype", "")  # SGLang does not report one: fingerprints in the sent dtype
        ranks = self.rollout.gpus_per_engine
        return [
            EngineTarget(
                engine_id=s.engine_id,
                url=s.url,
                num_ranks=ranks,
                rank_offset=1 + k * ranks,
                dtype=dtype_from_name(s.dtype) if s.dtype else None,
                api_key=self.rollout.api_key,
            )
            for k, s in enumerate(slots)
        ]

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
        """Push `source` to the engines over `transport` (default: the configured weight_sync), then
        verify every engine. Runs where the tensors are (the trainer's sending rank, or a test)."""
        transport = make_transport(
            transport or self.cfg.weight_sync,
            self.weight_targets(engine_ids),
            timeout_s=self.rollout.request_timeout_s,
            **transport_options,
        )
        transport.connect()
        try:
            report = transport.send(source, version)
        finally:
            transport.disconnect()
        self.verify(report, advance=advance)
        return report

    def verify(self, report: SyncReport, *, advance: bool = True) -> None:
        """Compare each engine's fingerprints and version with what was sent; an engine that differs
        is marked failed (it takes no more traffic) and WeightSyncError names it. With `advance` (a
        trainer's push) the fleet's version becomes the report's; a restore does not advance it: the
        background restarter may finish restoring version v after the trainer pushed v+1, and moving
        the fleet back to v would route generate traffic to the stale engine."""
        slots = {s.engine_id: s for s in self.slots}

        async def go():
            clients = {
                e: EngineClient(slots[e].url, api_key=self.rollout.api_key, timeout=self.rollout.request_timeout_s)
                for e in report.engine_ids
            }
            try:
                return await find_unverified(report, clients, self.cfg.verify_mode)
            finally:
                await asyncio.gather(*(c.close() for c in clients.values()))

        failed = asyncio.run(go())
        for engine_id in report.engine_ids:
            slot = slots[engine_id]
            if engine_id in failed:
                slot.lifecycle.to(EngineState.INACTIVE, f"weights not verified: {failed[engine_id]}")
            else:
                slot.version = report.version
                slot.lifecycle.to(EngineState.ACTIVE, f"verified at version {report.version!r}")
        if advance and len(failed) < len(report.engine_ids):
            self.version = report.version
            if isinstance(report, LoraSyncReport):
                self.lora_name = report.lora_name
        if failed:
            detail = "; ".join(f"engine {e}: {problem}" for e, problem in sorted(failed.items()))
            raise WeightSyncError(
                f"weight sync to version {report.version!r} not verified, engines marked failed: {detail}"
            )

    def status(self) -> list[dict]:
        return [
            {
                "engine_id": s.engine_id,
                "state": s.state.value,
                "version": s.version,
                "url": s.url,
                "outstanding": s.outstanding,
                "transitions": len(s.lifecycle.history),
            }
            for s in self.slots
        ]


def _sample(prompt_index: int, sample_index: int, prompt_ids: list[int], out: dict, engine_id: int) -> Sample:
    meta = out["meta_info"]
    return Sample(
        prompt_index=prompt_index,
        sample_index=sample_index,
        prompt_ids=prompt_ids,
        output_ids=list(out["output_ids"]),
        logprobs=[e[0] for e in meta.get("output_token_logprobs", [])],
        text=out.get("text", ""),
        finish_reason=meta["finish_reason"],
        weight_version=str(meta.get("weight_version", "")),
        engine_id=engine_id,
    )
