"""Placement of rollout workers: one placement-group bundle per GPU, packed within a node.

colocated: trainer and rollout workers share each bundle (each takes a GPU fraction);
disaggregated: the rollout world has bundles of its own (the trainer makes its own group).
An engine's GPUs must sit on one node; a layout that splits one is refused before any engine starts.
"""

from __future__ import annotations

import logging
import os

import ray
from ray.util.placement_group import PlacementGroup, placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rollfleet.config import RolloutConfig
from rollfleet.layout import RankInfo

log = logging.getLogger("rollfleet.fleet")


def bundle_resources(rollout: RolloutConfig) -> dict[str, float]:
    return {"GPU": 1.0, "CPU": 1.0} if rollout.use_gpu else {"CPU": 1.0}


def create_placement_group(rollout: RolloutConfig, timeout_s: float = 60.0, count: int | None = None) -> PlacementGroup:
    """One bundle per rollout GPU (`count`, default one per rank); waits with a timeout that names what is missing."""
    bundles = [bundle_resources(rollout) for _ in range(rollout.world_size if count is None else count)]
    group = placement_group(bundles, strategy="PACK")
    try:
        ray.get(group.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        ray.util.remove_placement_group(group)
        needed = {k: v * len(bundles) for k, v in bundles[0].items()}
        raise RuntimeError(
            f"Ray could not place {len(bundles)} rollout bundles of {bundles[0]} in {timeout_s:.0f} s: the fleet "
            f"needs {needed} (num_engines={rollout.num_engines} x tp_size={rollout.tp_size} x "
            f"pp_size={rollout.pp_size}), the cluster has {ray.cluster_resources()}; add nodes or GPUs, or lower "
            "rollout.num_engines"
        ) from None
    return group


def worker_options(group: PlacementGroup, bundle_index: int, rollout: RolloutConfig, share: float = 1.0) -> dict:
    """`share` < 1: another worker lives on the same bundle (a standby beside an engine)."""
    return {
        "scheduling_strategy": PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=bundle_index),
        "num_gpus": rollout.gpus_per_worker * share if rollout.use_gpu else 0,
        # CPU-side: colocated workers leave the bundle's CPU to the trainer actor sharing it
        "num_cpus": (0.5 if rollout.placement == "colocated" else 1.0) * share,
    }


def check_engines_on_one_node(ranks: list[RankInfo], node_of_rank: dict[int, str]) -> None:
    """Refuse a placement where one engine's ranks landed on different nodes."""
    split = {}
    for rank in ranks:
        split.setdefault(rank.engine_id, set()).add(node_of_rank[rank.rank])
    bad = {engine: nodes for engine, nodes in split.items() if len(nodes) > 1}
    if bad:
        detail = "; ".join(f"engine {e} on nodes {sorted(n)}" for e, n in sorted(bad.items()))
        raise ValueError(
            f"an engine's GPUs must be on one node, but Ray placed {detail}: give each node a "
            "multiple of tp_size*pp_size GPUs, or lower rollout.tp_size"
        )


# Ray starts its workers at niceness 15, so anything else busy on a node (data loading, reward
# functions, another job, a loaded CI runner) takes the CPU from the trainer ranks and the rollout
# workers, which are the run's critical path: measured on 2 busy cores, a trainer rank took 2 min to
# start and 1.3 s per tiny train step (0.04 s quiet). A Ray we start runs its workers at niceness 0.
LOCAL_RAY_SYSTEM_CONFIG = {"worker_niceness": 0}


def ensure_ray(cfg) -> None:
    """Ray as the run's config asks, unless a Ray is already running (the caller's: left as it is).
    A local Ray we start gives its workers the driver's priority (LOCAL_RAY_SYSTEM_CONFIG); a
    cluster's is set where it starts (`RAY_worker_niceness=0 ray start ...`)."""
    if ray.is_initialized():
        return
    options = {"num_cpus": cfg.ray.num_cpus, "num_gpus": cfg.ray.num_gpus, "_temp_dir": cfg.ray.temp_dir}
    if cfg.ray.address is None:
        init_local_ray(**options)
    else:
        ray.init(address=cfg.ray.address, include_dashboard=False, log_to_driver=False, **options)


def init_local_ray(**options) -> None:
    """A local Ray for rollfleet's workers (the runs', the tests', the benchmarks'): its workers at the
    driver's priority (LOCAL_RAY_SYSTEM_CONFIG), no dashboard, workers' output left in their logs."""
    ray.init(include_dashboard=False, log_to_driver=False, _system_config=LOCAL_RAY_SYSTEM_CONFIG, **options)


def warn_if_deprioritized(role: str) -> None:
    """In a Ray worker: a warning when this process runs below normal priority (a cluster started
    without RAY_worker_niceness=0), which a busy node turns into a slow run."""
    niceness = os.nice(0)
    if niceness > 0:
        log.warning(
            "%s runs at niceness %d (Ray's default for its workers): other work on this node takes its CPU "
            "first; start the cluster with RAY_worker_niceness=0 (`RAY_worker_niceness=0 ray start ...`)",
            role,
            niceness,
        )
