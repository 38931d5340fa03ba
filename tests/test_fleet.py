"""The fleet on a real local Ray with 4 fake GPUs: layout, device exposure, routing, sleep/wake,
and an engine killed mid-batch (every result still arrives exactly once)."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import ray

from rollfleet.config import load_config
from rollfleet.fleet.fleet import Fleet
from rollfleet.fleet.placement import create_placement_group, worker_options
from rollfleet.fleet.workers import RemoteRolloutWorker
from rollfleet.layout import build_rank_infos


def config(model_dir, log_dir, *overrides):
    return load_config(
        None,
        [
            f"rollout.model_path={model_dir}",
            "rollout.use_gpu=true",
            "rollout.auto_restart=false",
            f"rollout.log_dir={log_dir}",
            *overrides,
        ],
    )


def engine_env(pid: int) -> dict[str, str]:
    raw = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def test_moe_fleet_tp2_ep2_generates(local_ray, moe_dir, tmp_path):
    fleet = Fleet.from_config(config(moe_dir, tmp_path, "rollout.tp_size=2", "rollout.ep_size=2"))
    try:
        samples = fleet.generate([[1, 2, 3], [4, 5]], n=4, sampling={"max_new_tokens": 5, "ignore_eos": True})
        assert [(s.prompt_index, s.sample_index) for s in samples] == [(p, k) for p in range(2) for k in range(4)]
        assert all(len(s.output_ids) == 5 == len(s.logprobs) for s in samples)
    finally:
        fleet.shutdown()


def test_colocated_workers_share_a_gpu_with_a_trainer_actor(local_ray, qwen3_dir, tmp_path):
    @ray.remote(num_gpus=0.5, num_cpus=0.5)
    class TrainerStandIn:  # a co-tenant of the bundle; colocated trainers are placed the same way
        def gpu_ids(self):
            return [str(g) for g in ray.get_gpu_ids()]

    cfg = config(
        qwen3_dir,
        tmp_path,
        "rollout.num_engines=2",
        "rollout.placement=colocated",
        "rollout.gpus_per_worker=0.5",
        "trainer.world_size=2",
    ).rollout
    group = create_placement_group(cfg)
    try:
        ranks = build_rank_infos(2, 1, 1, 1)
        workers = [
            RemoteRolloutWorker.options(**worker_options(group, r.rank, cfg)).remote(r, cfg, str(tmp_path))
            for r in ranks
        ]
        trainers = [
            TrainerStandIn.options(
                **{k: v for k, v in worker_options(group, i, cfg).items() if k == "scheduling_strategy"}
            ).remote()
            for i in range(2)
        ]
        rollout_gpus = [p["gpu_ids"] for p in ray.get([w.placement.remote() for w in workers])]
        assert rollout_gpus == ray.get([t.gpu_ids.remote() for t in trainers])
        assert rollout_gpus[0] != rollout_gpus[1]
    finally:
        ray.util.remove_placement_group(group)


def test_sglang_pipeline_layout_reaches_launch_and_a_failed_start_reports_the_log(local_ray, qwen3_dir, tmp_path):
    """SGLang cannot run here: the fleet lays out tp=1 x pp=2, the head launches sglang.launch_server
    with both GPUs visible, and the start failure carries the server log's last lines."""
    cfg = config(qwen3_dir, tmp_path, "rollout.backend=sglang", "rollout.pp_size=2", "rollout.startup_timeout_s=60")
    with pytest.raises(ray.exceptions.RayTaskError) as err:
        Fleet.from_config(cfg)
    message = str(err.value)
    assert "EngineStartError" in message and "before it was up" in message
    assert "No module named 'sglang'" in message  # the tail of logs/engine-0.log
    assert (tmp_path / "engine-0.log").exists() and not (tmp_path / "engine-1.log").exists()


@pytest.fixture(scope="module")
def fleet(local_ray, qwen3_dir, tmp_path_factory):
    fleet = Fleet.from_config(
        config(qwen3_dir, tmp_path_factory.mktemp("logs"), "rollout.tp_size=2", "rollout.num_engines=2")
    )
    yield fleet
    fleet.shutdown()


def test_layout_and_gpu_exposure(fleet):
    placements = ray.get([w.placement.remote() for w in fleet.workers])
    gpu_ids = [p["gpu_ids"] for p in placements]
    assert all(len(ids) == 1 for ids in gpu_ids) and len({ids[0] for ids in gpu_ids}) == 4
    assert [p["cuda_visible_devices"] for p in placements] == [ids[0] for ids in gpu_ids]  # workers keep theirs
    for engine_id, head_rank in ((0, 0), (1, 2)):
        assert fleet.slots[engine_id].head is fleet.workers[head_rank]
        env = engine_env(ray.get(fleet.workers[head_rank].engine_pid.remote()))
        assert env["CUDA_VISIBLE_DEVICES"] == ",".join(gpu_ids[head_rank] + gpu_ids[head_rank + 1])
    shells = [fleet.workers[1], fleet.workers[3]]
    assert ray.get([w.start_engine.remote(["9"]) for w in shells]) == [None, None]
    assert ray.get([w.engine_alive.remote() for w in shells]) == [False, False]


def test_generate_spreads_over_engines_in_input_order(fleet):
    prompts = ["what is 12 plus 7?", [5, 6, 7], "the quick brown fox"] * 2
    samples = fleet.generate(prompts, n=4, sampling={"max_new_tokens": 6, "ignore_eos": True}, progress=True)
    assert len(samples) == 24
    assert [(s.prompt_index, s.sample_index) for s in samples] == [(p, k) for p in range(6) for k in range(4)]
    assert samples[4].prompt_ids == [5, 6, 7]
    assert {s.engine_id for s in samples} == {0, 1}
    assert all(s.weight_version == "default" and len(s.logprobs) == 6 for s in samples)


def test_sleep_and_wake_across_the_fleet(fleet, qwen3_dir):
    fleet.sleep(["kv_cache"])
    fleet.wake(["kv_cache"])
    assert len(fleet.generate([[1]], n=2, sampling={"max_new_tokens": 2})) == 2
    fleet.sleep()
    fleet.wake()
    fleet.update_weights_from_disk(qwen3_dir, weight_version="after-wake")
    samples = fleet.generate([[1], [2]], n=2, sampling={"max_new_tokens": 2})
    assert {s.weight_version for s in samples} == {"after-wake"}


def test_engine_killed_mid_batch_loses_no_result(fleet):
    victim = fleet.slots[1]
    pid = ray.get(victim.head.engine_pid.remote())

    def kill_soon():
        time.sleep(1.5)
        os.killpg(pid, signal.SIGKILL)

    killer = threading.Thread(target=kill_soon)
    killer.start()
    prompts = [[i % 50 + 1, 2, 3] for i in range(40)]
    samples = fleet.generate(prompts, n=2, sampling={"max_new_tokens": 200, "ignore_eos": True})
    killer.join()
    assert [(s.prompt_index, s.sample_index) for s in samples] == [(p, k) for p in range(40) for k in range(2)]
    assert all(len(s.output_ids) == 200 for s in samples)
    assert fleet.last_retries > 0
    assert [s["state"] for s in fleet.status()] == ["ACTIVE", "INACTIVE"]
    assert {s.engine_id for s in samples} <= {0, 1}
