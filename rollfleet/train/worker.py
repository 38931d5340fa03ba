"""Ray side of the trainer: one TrainWorker actor per GPU (or CPU rank), and TrainerGroup, the
driver's handle on all of them. Every verb runs on all ranks together (FSDP collectives); only
rank 0's answer is returned."""

from __future__ import annotations

import dataclasses
import gc
import logging
import threading
import time
from typing import Any

import ray
import torch
import torch.distributed as dist

from rollfleet.fleet.placement import warn_if_deprioritized
from rollfleet.layout import colocated_feeders
from rollfleet.train.sync_profile import SyncProfiler
from rollfleet.weights.transports import EngineTarget, SyncReport, make_transport
from rollfleet.weights.transports.base import transport_class
from rollfleet.weights.transports.feed import RankFeed
from rollfleet.wire.buckets import dtype_from_name
from rollfleet.wire.net import free_port

log = logging.getLogger("rollfleet.train")

DEFAULT_TIMEOUT_S = 600.0  # a transport's engine-call timeout when the options name none


class TrainWorker:
    def __init__(
        self,
        rank: int,
        world_size: int,
        master_port: int,
        model_path: str,
        train_config: dict,
        sampling_temperature: float = 1.0,
    ):
        from rollfleet.train.fsdp import PolicyTrainer, TrainConfig
        from rollfleet.train.sharding import init_distributed

        warn_if_deprioritized(f"trainer rank {rank}")
        init_distributed(rank, world_size, "127.0.0.1", master_port)
        self.rank = rank
        self.trainer = PolicyTrainer(model_path, TrainConfig(**train_config), sampling_temperature=sampling_temperature)
        # The model's and optimizer's objects live as long as the actor: out of the collector's scans, whose
        # full passes over them paused a weight push by 170-230 ms (the sync bench's sender, before this).
        gc.collect(), gc.freeze()
        self.transport, self.transport_key = None, None  # kept connected across steps (NCCL groups are costly)
        self.snapshots, self.snapshot_buffers = None, None
        self.copying: threading.Thread | None = None  # a snapshot's host copy under way (start_snapshot)
        self.copy_result: dict = {}
        self.feed_group = None  # the gloo group of an every-rank push (colocated tensor sync), made once
        self.sync_profiler = SyncProfiler(rank)  # ROLLFLEET_SYNC_PROFILE=DIR: one push under torch.profiler

    def train_step(self, batch: list[dict]) -> dict[str, float]:
        waited = self._settle_copy()
        return {**self.trainer.train_step(batch), "snapshot_copy_wait_seconds": waited}

    def gpu_ids(self) -> list[str]:
        """The GPUs Ray gave this rank (colocated: the same as the rollout worker of its bundle)."""
        return [str(g) for g in ray.get_gpu_ids()]

    def push_weights(
        self, spec, targets: list[EngineTarget], version: str, options: dict[str, Any], feeders=None
    ) -> SyncReport | None:
        """With `feeders` (colocated: engine id -> the trainer rank on each engine rank's GPU) and a
        transport that can, every rank packs the full tensors it gathers into its own device's buffer
        for the engine ranks on its GPU (rank 0 makes the calls). Otherwise rank 0 sends and the
        others take part in the gathers only."""
        self._settle_copy()
        every_rank = feeders is not None and transport_class(spec).feeds_from_every_rank
        # every rank keeps the tensors it gathered when every rank feeds; each shard is cast to the
        # engines' dtype before the gather (half the bytes of fp32 master weights for bf16 engines)
        source = self.trainer.weight_source(engine_dtype(targets), keep=every_rank or self.rank == 0)
        if not every_rank and self.rank != 0:
            for _ in source.named_tensors():
                pass
            return None
        transport = self._transport(spec, targets, options, feeders if every_rank else None)
        try:
            return self.sync_profiler.around(lambda: transport.send(source, version))
        except Exception:
            self.close_transport()  # a failed send may leave the group unusable: form a new one next time
            raise

    def _transport(self, spec, targets: list[EngineTarget], options: dict[str, Any], feeders):
        """The connected transport for these targets, made again only when they change."""
        key = (spec, tuple(targets), None if feeders is None else tuple(sorted(feeders.items())))
        if key != self.transport_key:
            self.close_transport()
            if feeders is not None:
                options = {**options, "feed": self._feed(feeders, options.get("timeout_s", DEFAULT_TIMEOUT_S))}
            self.transport = make_transport(spec, targets, **options)
            self.transport.connect()
            self.transport_key = key
        return self.transport

    def _feed(self, feeders, timeout_s: float) -> RankFeed:
        """This rank's place in an every-rank push; its gloo group is made once (every rank together)."""
        if self.feed_group is None:
            # waits cover rank 0's engine calls (a drain, then a commit or an abandon) and a margin
            self.feed_group = RankFeed.new_group(4 * timeout_s + 60)
        facts = {"trainer_rank": self.rank, "gpu_ids": self.gpu_ids()}
        return RankFeed(self.rank, dist.get_world_size(), feeders, self.feed_group, facts)

    def close_transport(self) -> None:
        if self.transport is not None:
            self.transport.disconnect()
        self.transport, self.transport_key = None, None

    def save_hf(self, path: str) -> None:
        self._settle_copy()
        self.trainer.save_hf(path)

    def save_state(self, path: str, extra: dict) -> None:
        self._settle_copy()
        self.trainer.save_state(path, extra)

    def load_state(self, path: str) -> dict:
        self._settle_copy()
        return self.trainer.load_state(path)

    def offload(self) -> dict:
        self._settle_copy()
        return self.trainer.offload()

    def onload(self) -> dict:
        self._settle_copy()
        return self.trainer.onload()

    def copy_ceiling(self, nbytes: int) -> dict | None:
        """Pinned host<->device GB/s for `nbytes` on this rank's device (None on CPU)."""
        from rollfleet.train.host_copy import pinned_copy_ceiling

        return pinned_copy_ceiling(nbytes, self.trainer.device)

    # ---- recovery snapshots (rollfleet.train.snapshot) ----
    def start_snapshot(self, version: str, root: str, dtype: str | None) -> dict:
        """Start the snapshot of the weights just pushed and return at once: every rank gathers, and
        rank 0 copies into host buffers reused across steps, on a thread of this actor (while the
        engines generate, when the trainer is idle); then rank 0's writer writes the copy in the
        background. The caller starts one only after `wait_snapshot` answered for the last.

        Ordering: the copy's gathers are collectives of the trainer's group, so every verb that
        touches the parameters (or runs collectives) first waits for the copy (`_settle_copy`); the
        weights therefore cannot change under the copy, and no two collectives interleave."""
        from rollfleet.train.host_copy import HostBuffers
        from rollfleet.train.snapshot import SnapshotWriter

        start = time.perf_counter()
        self._settle_copy()
        trainer = self.trainer
        if self.snapshots is None or str(self.snapshots.root) != root:
            self.snapshots = SnapshotWriter(root, trainer.model_path) if self.rank == 0 else None
            self.snapshot_buffers = HostBuffers(pin=trainer.device.type == "cuda")
        # each shard is cast to the engines' dtype before it is gathered and copied
        source = trainer.weight_source(dtype_from_name(dtype) if dtype else None)
        self.copying = threading.Thread(
            target=self._copy_then_write, args=(version, source), name=f"rollfleet-host-copy-{version}", daemon=True
        )
        self.copy_result = {}
        self.copying.start()
        return {"started": True, "copy_seconds": time.perf_counter() - start}

    def _copy_then_write(self, version: str, source) -> None:
        from rollfleet.train.snapshot import take_host_copy

        start = time.perf_counter()
        try:
            if self.trainer.device.type == "cuda":
                torch.cuda.set_device(self.trainer.device)  # a new thread starts on the first device
            copy = take_host_copy(source, self.snapshot_buffers, self.trainer.device, keep=self.rank == 0)
            if self.snapshots is not None:
                self.snapshots.start(version, copy)
        except Exception as exc:  # noqa: BLE001 - the snapshot's waiter raises it (a lost restore source)
            self.copy_result = {"error": exc}
        else:
            self.copy_result = {"copy_seconds": time.perf_counter() - start}

    def _settle_copy(self) -> float:
        """Wait for a host copy still running (normally done long before); seconds waited."""
        start = time.perf_counter()
        if self.copying is not None:
            self.copying.join()
            self.copying = None
        return time.perf_counter() - start

    @ray.method(concurrency_group="snapshot")
    def wait_snapshot(self) -> dict | None:
        """The last snapshot's result once written, with its host copy's seconds (runs beside the
        trainer's verbs: its own thread); raises what stopped the copy or the write."""
        copying = self.copying
        if copying is not None:
            copying.join()
        if "error" in self.copy_result:
            raise self.copy_result["error"]
        result = self.snapshots.wait() if self.snapshots is not None else None
        return None if result is None else {**dataclasses.asdict(result), **self.copy_result}

    def cancel_snapshot(self) -> None:
        self._settle_copy()
        if self.snapshots is not None:
            self.snapshots.close(cancel=True)


# wait_snapshot blocks until a background write ends: it gets its own thread so train_step, push and
# offload keep running meanwhile.
def engine_dtype(targets: list[EngineTarget]) -> torch.dtype | None:
    """The one dtype every target serves in (the sender casts to it), or None: engines of several
    dtypes, or one that does not say (SGLang), get the trainer's own and cast on load."""
    dtypes = {t.dtype for t in targets}
    return dtypes.pop() if len(dtypes) == 1 else None


RemoteTrainWorker = ray.remote(concurrency_groups={"snapshot": 1})(TrainWorker)


class TrainerGroup:
    """All trainer ranks. Colocated: each rank sits in the fleet's bundle of the same index and takes
    the GPU fraction the rollout worker left; disaggregated: plain actors with a GPU each."""

    def __init__(self, cfg, placement_group=None, *, wait: bool = True):
        """The ranks' actors are created; with `wait` False the caller waits in `ready()` (the actors
        build their models meanwhile, e.g. while the fleet's engines start)."""
        self.cfg, self.placement_group = cfg, placement_group
        self.workers = self._create(free_port())
        if wait:
            self.ready()
        # colocated: each rank feeds the engine ranks on its own GPU (transports that can: tensor)
        colocated = placement_group is not None
        self.feeders = colocated_feeders(cfg.rollout.layout, cfg.trainer.world_size) if colocated else None

    def _create(self, port: int) -> list:
        rollout, world, group = self.cfg.rollout, self.cfg.trainer.world_size, self.placement_group
        workers = []
        for rank in range(world):
            options: dict[str, Any] = {"num_cpus": 0.5 if group is not None else 1}
            if rollout.use_gpu:
                options["num_gpus"] = 1.0 - rollout.gpus_per_worker if group is not None else 1.0
            if group is not None:
                from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

                options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                    group, placement_group_bundle_index=rank
                )
            workers.append(
                RemoteTrainWorker.options(**options).remote(
                    rank, world, port, rollout.model_path, self.cfg.train.model_dump(), rollout.sampling.temperature
                )
            )
        return workers

    def ready(self, attempts: int = 3) -> TrainerGroup:
        """Wait for every rank. The master port was free when chosen, but another process may bind it
        before rank 0 does (engines start at the same time): then the ranks are made again on a new
        port, up to `attempts` times."""
        for attempt in range(attempts):
            try:
                ray.get([w.__ray_ready__.remote() for w in self.workers])
                return self
            except ray.exceptions.RayActorError as exc:
                if attempt == attempts - 1 or "address already in use" not in str(exc).lower():
                    raise
                log.warning("trainer master port taken by another process; the ranks start again on a new one")
                self.shutdown()
                self.workers = self._create(free_port())
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _all(self, verb: str, *args) -> Any:
        return ray.get([getattr(w, verb).remote(*args) for w in self.workers])[0]

    def train_step(self, batch: list[dict]) -> dict[str, float]:
        return self._all("train_step", batch)

    def gpu_ids(self) -> list[list[str]]:
        """Each rank's GPU ids, by rank."""
        return ray.get([w.gpu_ids.remote() for w in self.workers])

    def push_weights(self, spec, targets, version: str, **options) -> SyncReport:
        return self._all("push_weights", spec, targets, version, options, self.feeders)

    def save_hf(self, path: str) -> None:
        self._all("save_hf", path)

    def save_state(self, path: str, extra: dict) -> None:
        self._all("save_state", path, extra)

    def load_state(self, path: str) -> dict:
        return self._all("load_state", path)

    def offload(self) -> dict:
        """Rank 0's bytes moved and seconds (every rank moves its own shard, in parallel)."""
        return self._all("offload")

    def onload(self) -> dict:
        return self._all("onload")

    def copy_ceiling(self, nbytes: int) -> dict | None:
        return ray.get(self.workers[0].copy_ceiling.remote(nbytes))

    def start_snapshot(self, version: str, root: str, dtype: str | None = None) -> dict:
        return self._all("start_snapshot", version, root, dtype)

    def snapshot_written(self) -> ray.ObjectRef:
        """Resolves to the last snapshot's result (a dict) once its write ends, or raises its error."""
        return self.workers[0].wait_snapshot.remote()

    def cancel_snapshot(self) -> None:
        self._all("cancel_snapshot")

    def shutdown(self) -> None:
        for worker in self.workers:
            ray.kill(worker)
