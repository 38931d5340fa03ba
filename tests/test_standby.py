"""Warm standby engines on a real Ray fleet (2 serving engines + 1 standby, tiny model, CPU): a
killed engine's place is taken by the standby, restored from its peer and verified before it
serves, generate loses and duplicates nothing meanwhile, the dead slot comes back as the standby,
and pushes go to the serving engines only."""

from __future__ import annotations

import shutil
import tempfile
import threading
import time

import pytest
import ray
from conftest import kill, reference_greedy
from transformers import AutoModelForCausalLM

from rollfleet.config import ConfigError, load_config
from rollfleet.fleet.fleet import Fleet
from rollfleet.weights.source import ModuleSource

GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
PROMPTS = [[4, 8, 15], [16, 23, 42], [7, 7], [1, 2], [3, 1, 4, 1], [5, 9, 2, 6]]


@pytest.fixture(scope="module")
def fleet(qwen3_dir, tmp_path_factory):
    temp = tempfile.mkdtemp(prefix="rf-ray-")
    ray.init(num_cpus=8, num_gpus=3, _temp_dir=temp, include_dashboard=False, log_to_driver=False)
    out = tmp_path_factory.mktemp("standby")
    cfg = load_config(
        None,
        [
            f"rollout.model_path={qwen3_dir}",
            "rollout.use_gpu=true",  # Ray GPUs for placement; the engines run on the CPU
            "rollout.num_engines=2",
            "rollout.standby_engines=1",
            f"rollout.log_dir={out}/logs",
            "rollout.recovery_wait_s=60",
            "rollout.probe_interval_s=0.5",
            "rollout.probe_timeout_s=2",
            "rollout.restore_timeout_s=30",
            "weight_sync.transport=disk",
            f"weight_sync.path={out}/sync",
        ],
    )
    fleet = Fleet.from_config(cfg)
    yield fleet
    fleet.shutdown()
    ray.shutdown()
    shutil.rmtree(temp, ignore_errors=True)


def wait_for(condition, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return condition()


def roles(fleet):
    return {s.engine_id: (s.state.value, s.standby) for s in fleet.slots}


def test_standby_engines_are_refused_on_a_colocated_fleet():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["rollout.model_path=m", "rollout.placement=colocated", "rollout.standby_engines=1"])
    message = str(err.value)
    assert "standby_engines" in message and "1" in message and "placement=disaggregated" in message
    cfg = load_config(None, ["rollout.model_path=m", "rollout.standby_engines=2"])
    assert cfg.rollout.standby_engines == 2 and cfg.rollout.num_engines == 1


def test_a_standby_takes_a_dead_engines_place_and_the_dead_one_becomes_the_standby(fleet, qwen3_dir_b):
    assert roles(fleet) == {0: ("ACTIVE", False), 1: ("ACTIVE", False), 2: ("AWAITING_WEIGHTS", True)}
    trained = AutoModelForCausalLM.from_pretrained(qwen3_dir_b)
    assert fleet.sync_weights(ModuleSource(trained), "v1").verified == [0, 1]  # the standby takes no push
    assert fleet.slots[2].version == "" and fleet.slots[2].state.value == "AWAITING_WEIGHTS"

    prompts, results = PROMPTS * 10, {}
    generating = threading.Thread(target=lambda: results.update(out=fleet.generate(prompts, n=2, sampling=GREEDY)))
    generating.start()
    time.sleep(0.3)
    killed_at = kill(fleet, 0)
    killed_mid_generate = generating.is_alive()
    assert wait_for(lambda: fleet.slots[2].state.value == "ACTIVE", timeout=20)
    took_over_s = time.monotonic() - killed_at
    assert not fleet.slots[2].standby and fleet.slots[2].version == "v1"
    assert fleet.slots[2].lifecycle.history[-1].why.endswith("(peer)")  # restored from the peer, verified
    assert fleet.pool.call(2, "weights_fingerprint", None) == fleet.pool.call(1, "weights_fingerprint", None)
    generating.join(timeout=60)
    assert killed_mid_generate and not generating.is_alive()

    samples = results["out"]  # nothing lost, nothing twice, every answer the trained model's
    assert sorted((s.prompt_index, s.sample_index) for s in samples) == [
        (i, k) for i in range(len(prompts)) for k in (0, 1)
    ]
    assert {s.weight_version for s in samples} == {"v1"}
    expected = {tuple(p): reference_greedy(qwen3_dir_b, p, 8)[0] for p in PROMPTS}
    assert all(s.output_ids == expected[tuple(s.prompt_ids)] for s in samples)

    # the dead slot restarts in the background as the standby: dummy weights, not routed
    assert wait_for(lambda: roles(fleet)[0] == ("AWAITING_WEIGHTS", True), timeout=30)
    assert fleet.slots[0].version == "" and "as a standby" in fleet.slots[0].lifecycle.history[-1].why
    after = fleet.generate(PROMPTS * 2, sampling=GREEDY)
    assert {s.engine_id for s in after} == {1, 2}
    print(f"kill -> standby ACTIVE in {took_over_s:.2f} s")
    assert took_over_s < 10


def test_pushes_go_to_the_serving_engines_and_a_dead_standby_is_restarted(fleet, qwen3_dir):
    assert wait_for(lambda: roles(fleet)[0] == ("AWAITING_WEIGHTS", True))
    base = AutoModelForCausalLM.from_pretrained(qwen3_dir)
    report = fleet.sync_weights(ModuleSource(base), "v2")
    assert report.engine_ids == [1, 2] and report.verified == [1, 2] and fleet.version == "v2"
    assert fleet.slots[0].version == "" and fleet.slots[0].state.value == "AWAITING_WEIGHTS"
    samples = fleet.generate(PROMPTS, sampling=GREEDY)
    assert all(s.output_ids == reference_greedy(qwen3_dir, s.prompt_ids, 8)[0] for s in samples)

    url = fleet.slots[0].url
    kill(fleet, 0)  # the standby dies: it comes back as a standby, and no serving engine moves
    assert wait_for(lambda: fleet.slots[0].url != url and roles(fleet)[0] == ("AWAITING_WEIGHTS", True))
    assert roles(fleet) == {0: ("AWAITING_WEIGHTS", True), 1: ("ACTIVE", False), 2: ("ACTIVE", False)}
