"""Placing and starting a fleet's engines, and taking them down: the layout checked against the
model, Ray, one placement group (standbys on bundles of their own or beside an engine), a worker
per GPU, the node check, then every engine started in parallel. `Fleet.from_config` runs it; a
start that fails takes down what it made (no worker or group outlives it)."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path

import ray
from transformers import AutoConfig

from rollfleet.config import RunConfig
from rollfleet.config.lora import engine_sync_spec
from rollfleet.fleet import standby
from rollfleet.fleet.lifecycle import EngineSlot
from rollfleet.fleet.placement import check_engines_on_one_node, create_placement_group, ensure_ray, worker_options
from rollfleet.fleet.workers import RemoteRolloutWorker
from rollfleet.layout import engine_rank_groups
from rollfleet.weights.transports.base import transport_class
from rollfleet.wire.routed_experts import ROUTED_EXPERTS_FLAG


def place_and_start(cfg: RunConfig, load_format: str, on_placement: Callable | None) -> tuple:
    """(placement group, workers, slots) with every engine up; `on_placement(group)` runs once the
    group exists, before the engines start (the loop creates its trainers there)."""
    rollout, layout = cfg.rollout, cfg.rollout.layout
    layout.check_model(
        AutoConfig.from_pretrained(rollout.model_path), allow_kv_head_replication=rollout.backend == "sglang"
    )
    ensure_ray(cfg)
    placed = standby.with_standbys(rollout)  # serving engines, then standbys on bundles of their own
    ranks = placed.layout.ranks()
    group = create_placement_group(placed, count=standby.bundle_count(rollout))
    if on_placement is not None:
        on_placement(group)
    log_dir = str(Path(rollout.log_dir).resolve())
    # engines serve what the transport sends (a LoRA run: --enable-lora ...)
    sync = engine_sync_spec(cfg)
    extras = [*transport_class(sync).server_args(sync), *rollout.server_extras]
    if cfg.train.routing_replay:  # the trainer replays the engines' expert choices
        extras.append(ROUTED_EXPERTS_FLAG)
    rollout = rollout.model_copy(update={"server_extras": extras})
    workers = [_worker(group, rollout, r, log_dir) for r in ranks]
    try:
        placements = ray.get([w.placement.remote() for w in workers])
        check_engines_on_one_node(ranks, {p["rank"]: p["node_id"] for p in placements})
        formats = partial(standby.start_format, cfg=cfg, load_format=load_format)
        slots = _start_engines(ranks, workers, placements, formats)
        standby.mark_started(slots, rollout.num_engines, load_format)
    except BaseException:
        teardown(workers, group)
        raise
    return group, workers, slots


def _worker(group, rollout, rank, log_dir: str):
    """Rank `rank`'s worker, on its bundle (a standby beside an engine shares that engine's)."""
    options = worker_options(
        group, standby.bundle_index(rollout, rank), rollout, share=standby.bundle_share(rollout, rank)
    )
    return RemoteRolloutWorker.options(**options).remote(
        rank, standby.with_mem_fraction(rollout, rank.engine_id), log_dir
    )


def _start_engines(ranks, workers, placements, load_format_of: Callable[[int], str]) -> list[EngineSlot]:
    slots, starts = [], []
    for engine_id, members in sorted(engine_rank_groups(ranks).items()):
        gpu_ids = [g for m in members for g in placements[m.rank]["gpu_ids"]]
        head = workers[members[0].rank]
        slots.append(EngineSlot(engine_id, "", head, gpu_ids=gpu_ids))
        starts.append(head.start_engine.remote(gpu_ids, load_format_of(engine_id)))
    for slot, info in zip(slots, ray.get(starts)):  # engines start in parallel; a failure raises with its log
        slot.url = info["url"]
    return slots


def teardown(workers, group) -> None:
    ray.get([w.stop_engine.remote() for w in workers], timeout=60)
    for worker in workers:
        ray.kill(worker)
    ray.util.remove_placement_group(group)
