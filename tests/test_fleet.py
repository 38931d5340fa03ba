"""The fleet on a real local Ray with 4 fake GPUs: layout, device exposure, routing, sleep/wake,
the colocated trainer group sharing each GPU, and an engine killed mid-batch (every result still
arrives exactly once). A tp=2 ep=2 MoE fleet generates in test_weight_sync (its moe_fleet)."""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
from pathlib import Path

import httpx
import pytest
import ray
from conftest import Lender, hold_with_requests, pause_engine, reference_greedy, serving_again
from transformers import AutoModelForCausalLM

from rollfleet.config import load_config
from rollfleet.fleet.fleet import Fleet
from rollfleet.fleet.placement import create_placement_group, worker_options
from rollfleet.fleet.workers import RemoteRolloutWorker
from rollfleet.layout import Layout
from rollfleet.train.sample_stream import prompt_seeds
from rollfleet.train.worker import TrainerGroup
from rollfleet.wire.client import SUPPORTED_SGLANG, UnsupportedEngine


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


def test_colocated_trainer_group_shares_each_gpu_with_its_rollout_worker(
    local_ray, free_gpus, qwen3_dir, tmp_path, monkeypatch
):
    """The real TrainerGroup (FSDP2 ranks on gloo) in the fleet's placement group: each rank takes the
    GPU fraction the rollout worker of its bundle left, so both see the same GPU id. Its first master
    port is one another process listens on (a port taken between its choice and rank 0's bind): the
    ranks start again on another."""
    import socket

    import rollfleet.train.worker as trainer_workers

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = iter([taken.getsockname()[1]])
    real_free_port = trainer_workers.free_port
    monkeypatch.setattr(trainer_workers, "free_port", lambda: next(ports, None) or real_free_port())
    cfg = config(
        qwen3_dir,
        tmp_path,
        "rollout.num_engines=2",
        "rollout.placement=colocated",
        "rollout.gpus_per_worker=0.5",
        "trainer.world_size=2",
    )
    group = create_placement_group(cfg.rollout)
    trainers = None
    try:
        ranks = Layout(num_engines=2).ranks()
        workers = [
            RemoteRolloutWorker.options(**worker_options(group, r.rank, cfg.rollout)).remote(
                r, cfg.rollout, str(tmp_path)
            )
            for r in ranks
        ]
        trainers = TrainerGroup(cfg, group)
        rollout_gpus = [p["gpu_ids"] for p in ray.get([w.placement.remote() for w in workers])]
        assert rollout_gpus == trainers.gpu_ids()
        assert rollout_gpus[0] != rollout_gpus[1] and all(len(ids) == 1 for ids in rollout_gpus)
        assert ray.available_resources().get("GPU", 0) == 2  # two bundles of 1 GPU, each split 0.5 + 0.5
        assert next(ports, None) is None  # the taken port was tried first
    finally:
        taken.close()
        if trainers is not None:
            trainers.shutdown()
        ray.util.remove_placement_group(group)


def test_sglang_pipeline_layout_reaches_launch_and_a_failed_start_reports_the_log(
    local_ray, free_gpus, qwen3_dir, tmp_path
):
    """SGLang cannot run here: the fleet lays out tp=1 x pp=2, the head launches sglang.launch_server
    with both GPUs visible, and the start failure carries the server log's last lines."""
    cfg = config(qwen3_dir, tmp_path, "rollout.backend=sglang", "rollout.pp_size=2", "rollout.startup_timeout_s=60")
    with pytest.raises(ray.exceptions.RayTaskError) as err:
        Fleet.from_config(cfg)
    message = str(err.value)
    assert "EngineStartError" in message and "before it was up" in message
    assert "No module named 'sglang'" in message  # the tail of logs/engine-0.log
    assert (tmp_path / "engine-0.log").exists() and not (tmp_path / "engine-1.log").exists()


@pytest.mark.parametrize("release, supported", [("0.4.0", False), ("0.5.23.post1", True)])
def test_the_fleet_reads_each_sglang_release_at_start_and_refuses_an_unsupported_one(
    local_ray, free_gpus, qwen3_dir, tmp_path, release, supported
):
    """backend=sglang through the real launch path (a worker starts `rollout.sglang_command`, here a
    stand-in server process reporting `release`): the fleet reads /get_server_info once per engine
    and refuses a release outside SUPPORTED_SGLANG at start, naming engine, release, range and fix,
    with nothing left running; a supported release starts and its answer is kept for the senders."""
    server = str(Path(__file__).with_name("sglang_release_server.py"))
    cfg = config(
        qwen3_dir,
        tmp_path,
        "rollout.backend=sglang",
        f"rollout.sglang_command=['{sys.executable}', '{server}', '{release}']",
    )
    low, high = (".".join(map(str, v)) for v in SUPPORTED_SGLANG)
    if not supported:
        with pytest.raises(UnsupportedEngine) as err:
            Fleet.from_config(cfg)
        message = str(err.value)
        assert message.startswith("engine 0: http://127.0.0.1:") and "version='0.4.0'" in message
        assert f"{low} to {high}" in message and "run a release in that range" in message
        assert "rollout.sglang_command" in message
        pid = int(re.search(r"engine pid (\d+)", (tmp_path / "engine-0.log").read_text()).group(1))
        assert not Path(f"/proc/{pid}").exists()  # the refused server was stopped (and reaped)
        return
    fleet = Fleet.from_config(cfg)
    try:
        assert fleet.pool.client(0)._server_info["version"] == release  # read at start, kept for the senders
        assert fleet.slots[0].state.name == "ACTIVE"
    finally:
        fleet.shutdown()


@pytest.fixture(scope="module")
def fleet_lender(local_ray, qwen3_dir, tmp_path_factory):
    """The module's fleet (2 engines of tp 2: all 4 of the local Ray's GPUs), started when a test
    first asks for it and given back when a test needs the GPUs for a fleet of its own."""

    def start(stack):
        fleet = Fleet.from_config(
            config(qwen3_dir, tmp_path_factory.mktemp("logs"), "rollout.tp_size=2", "rollout.num_engines=2")
        )
        stack.callback(fleet.shutdown)
        return fleet

    lender = Lender(start)
    yield lender
    lender.release()


@pytest.fixture
def fleet(fleet_lender):
    return fleet_lender.get()


@pytest.fixture
def free_gpus(fleet_lender):
    """The Ray GPUs free for a fleet of the test's own, whether or not a test before started the module's."""
    fleet_lender.release()


@pytest.fixture
def serving(fleet, qwen3_dir):
    """The fleet with both engines ACTIVE on qwen3_dir's weights (a test before may have killed one)."""
    serving_again(fleet, AutoModelForCausalLM.from_pretrained(qwen3_dir))
    return fleet


def test_layout_and_gpu_exposure(fleet, serving):
    placements = ray.get([w.placement.remote() for w in fleet.workers])
    gpu_ids = [p["gpu_ids"] for p in placements]
    assert all(len(ids) == 1 for ids in gpu_ids) and len({ids[0] for ids in gpu_ids}) == 4
    assert [p["cuda_visible_devices"] for p in placements] == [ids[0] for ids in gpu_ids]  # workers keep theirs
    for engine_id, head_rank in ((0, 0), (1, 2)):
        assert fleet.slots[engine_id].head is fleet.workers[head_rank]
        info = httpx.get(fleet.slots[engine_id].url + "/get_server_info", timeout=30).json()
        assert info["rollfleet_cuda_visible_devices"] == ",".join(gpu_ids[head_rank] + gpu_ids[head_rank + 1])
    shells = [fleet.workers[1], fleet.workers[3]]
    assert ray.get([w.start_engine.remote(["9"]) for w in shells]) == [None, None]
    assert ray.get([w.engine_alive.remote() for w in shells]) == [False, False]


def test_generate_spreads_over_engines_in_input_order(fleet, serving, qwen3_dir):
    prompts = ["what is 12 plus 7?", [5, 6, 7], "the quick brown fox", [9], [40, 41], "seven"]
    greedy = {"max_new_tokens": 6, "ignore_eos": True, "temperature": 0}
    samples = fleet.generate(prompts, n=4, sampling=greedy, progress=True)
    assert len(samples) == 24
    assert [(s.prompt_index, s.sample_index) for s in samples] == [(p, k) for p in range(6) for k in range(4)]
    prompt_ids = [fleet.tokenizer.encode(p) if isinstance(p, str) else p for p in prompts]
    assert [s.prompt_ids for s in samples] == [ids for ids in prompt_ids for _ in range(4)]
    # each sample answers its own prompt: the greedy continuation a plain forward pass gives for it
    assert [s.output_ids for s in samples] == [
        reference_greedy(qwen3_dir, ids, 6)[0] for ids in prompt_ids for _ in range(4)
    ]
    assert {s.engine_id for s in samples} == {0, 1}
    assert all(s.weight_version == fleet.version and len(s.logprobs) == 6 for s in samples)


def test_sleep_and_wake_across_the_fleet(fleet, serving, qwen3_dir):
    fleet.sleep(["kv_cache"])
    fleet.wake(["kv_cache"])
    assert len(fleet.generate([[1]], n=2, sampling={"max_new_tokens": 2})) == 2
    fleet.sleep()
    fleet.wake()
    fleet.update_weights_from_disk(qwen3_dir, weight_version="after-wake")
    samples = fleet.generate([[1], [2]], n=2, sampling={"max_new_tokens": 2})
    assert {s.weight_version for s in samples} == {"after-wake"}


def test_seeded_samples_depend_on_their_seed_alone(fleet, serving):
    """A prompt's seeded samples are the same whichever engine serves it and whatever else the call
    holds (a prompt alone, or among 40 spread over both engines); another run seed draws others."""
    prompts = [[i + 1, 2, 3] for i in range(40)]
    sampled = {"max_new_tokens": 8, "ignore_eos": True, "temperature": 1.0}
    spread = fleet.generate(prompts, n=2, sampling=sampled, seeds=prompt_seeds(0, range(40)))
    assert {s.engine_id for s in spread} == {0, 1}
    for i in (0, 1, 39):
        alone = fleet.generate([prompts[i]], n=2, sampling=sampled, seeds=prompt_seeds(0, [i]))
        assert [s.output_ids for s in alone] == [s.output_ids for s in spread[2 * i : 2 * i + 2]]
    other = fleet.generate(prompts[:4], n=2, sampling=sampled, seeds=prompt_seeds(1, range(4)))
    assert [s.output_ids for s in other] != [s.output_ids for s in spread[:8]]
    with pytest.raises(ValueError, match="2 seeds for 3 prompts"):
        fleet.generate(prompts[:3], seeds=[1, 2])


def test_engine_killed_mid_batch_loses_no_result(fleet, serving):
    """Seeded: a request retried on the other engine carries its seed, so every sample is the one its
    seed drew in a call before the kill."""
    prompts, seeds = [[i + 1, 2, 3] for i in range(40)], prompt_seeds(0, range(40))
    sampled = {"max_new_tokens": 100, "ignore_eos": True, "temperature": 1.0}
    before = fleet.generate(prompts, n=2, sampling=sampled, seeds=seeds)
    victim = fleet.slots[1]
    pid = ray.get(victim.head.engine_pid.remote())
    busy = threading.Event()

    def kill_mid_batch():  # engine 1 held with requests mid-batch (paused, stepped), then killed
        try:
            hold_with_requests(fleet, 1, alive=lambda: not samples_done.is_set(), steps=2)
            busy.set()
        finally:  # also when the hold failed: the generate must not wait on a paused engine
            os.killpg(pid, signal.SIGKILL)

    samples_done = threading.Event()
    pause_engine(fleet, 1)  # before the generate: its requests cannot all be done before the hold
    killer = threading.Thread(target=kill_mid_batch)
    killer.start()
    retries = fleet.router.retries
    try:
        samples = fleet.generate(prompts, n=2, sampling=sampled, seeds=seeds)
    finally:
        samples_done.set()
    killer.join()
    assert busy.is_set() and fleet.router.retries > retries  # the kill hit requests in flight
    assert [(s.prompt_index, s.sample_index) for s in samples] == [(p, k) for p in range(40) for k in range(2)]
    assert all(len(s.output_ids) == 100 for s in samples)
    # a retried sample restarted from scratch on a live engine at the fleet's version: one whole span
    assert all(s.weight_versions == [{"version": fleet.version, "start": 0, "end": 100}] for s in samples)
    # every sample, retried or not, is its seed's draw (the first 8 tokens: where an engine's float sums
    # vary with its batch, on a GPU or with several threads, a long sample's later draw may flip)
    assert [s.output_ids[:8] for s in samples] == [s.output_ids[:8] for s in before]
    assert [s.state.value for s in fleet.slots] == ["ACTIVE", "INACTIVE"]
    assert {s.engine_id for s in samples} <= {0, 1}
