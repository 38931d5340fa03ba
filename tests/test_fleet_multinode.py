"""Placement on a simulated multi-node Ray cluster: an engine's GPUs stay on one node, and a layout
that would split one is refused before any engine starts."""

from __future__ import annotations

import os
import shutil
import tempfile
import time

import pytest
import ray
from conftest import shared_zygote
from ray.cluster_utils import Cluster

from rollfleet.config import load_config
from rollfleet.fleet.fleet import Fleet
from rollfleet.fleet.placement import (
    LOCAL_RAY_SYSTEM_CONFIG,
    check_engines_on_one_node,
    create_placement_group,
    worker_options,
)
from rollfleet.fleet.workers import RemoteRolloutWorker
from rollfleet.layout import Layout


@pytest.fixture(scope="module")
def cluster():
    shared_zygote()  # its nodes' engine workers fork their engines from it (conftest: SHARED_ZYGOTE_ENV)
    temp = tempfile.mkdtemp(prefix="rf-cl-")
    saved = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = temp  # the Cluster helper writes its address file under Ray's temp dir
    os.makedirs(os.path.join(temp, "ray"))
    # node A (the head): 2 GPUs; nodes B and C: 1 GPU each
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "num_gpus": 2, "temp_dir": temp, "_system_config": LOCAL_RAY_SYSTEM_CONFIG},
    )
    for _ in range(2):
        cluster.add_node(num_cpus=2, num_gpus=1)
    ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
    yield cluster
    ray.shutdown()
    cluster.shutdown()
    if saved is None:
        os.environ.pop("RAY_TMPDIR")
    else:
        os.environ["RAY_TMPDIR"] = saved
    shutil.rmtree(temp, ignore_errors=True)


def rollout_config(model_dir, log_dir, *overrides):
    return load_config(
        None,
        [
            f"rollout.model_path={model_dir}",
            "rollout.use_gpu=true",
            "rollout.tp_size=2",
            f"rollout.log_dir={log_dir}",
            *overrides,
        ],
    )


def test_a_tp2_engine_is_packed_on_one_node(cluster, qwen3_dir, tmp_path):
    cfg = rollout_config(qwen3_dir, tmp_path).rollout
    group = create_placement_group(cfg)
    try:
        ranks = Layout(num_engines=1, tp_size=2).ranks()
        workers = [
            RemoteRolloutWorker.options(**worker_options(group, r.rank, cfg)).remote(r, cfg, str(tmp_path))
            for r in ranks
        ]
        placements = ray.get([w.placement.remote() for w in workers])
        assert placements[0]["node_id"] == placements[1]["node_id"]
        check_engines_on_one_node(ranks, {p["rank"]: p["node_id"] for p in placements})
        for worker in workers:
            ray.kill(worker)
    finally:
        ray.util.remove_placement_group(group)


def test_a_layout_that_splits_an_engine_is_refused_before_engines_start(cluster, qwen3_dir, tmp_path):
    cfg = rollout_config(qwen3_dir, tmp_path, "rollout.num_engines=2")
    with pytest.raises(ValueError) as err:
        Fleet.from_config(cfg)
    assert "engine 1 on nodes" in str(err.value) and "one node" in str(err.value)
    assert not list(tmp_path.glob("engine-*.log"))  # no engine was started
    deadline = time.monotonic() + 20  # and the placement group is given back (Ray frees it asynchronously)
    while ray.available_resources().get("GPU", 0) < 4 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("GPU", 0) == 4
