"""Recovery on a real Ray fleet: a dead engine is noticed at once, restarted with dummy weights,
refuses generate until its weights are restored and verified, and generation waits for recovery
when no engine is ACTIVE."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import threading
import time

import httpx
import pytest
import ray
import torch
from conftest import reference_greedy
from transformers import AutoModelForCausalLM

from rollfleet.config import load_config
from rollfleet.fleet.fleet import Fleet
from rollfleet.weights.source import ModuleSource

GREEDY = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
PROMPTS = [[4, 8, 15], [16, 23, 42], [7, 7], [1, 2]]


@pytest.fixture(scope="module")
def fleet(qwen3_dir, tmp_path_factory):
    temp = tempfile.mkdtemp(prefix="rf-ray-")
    ray.init(num_cpus=8, num_gpus=2, _temp_dir=temp, include_dashboard=False, log_to_driver=False)
    out = tmp_path_factory.mktemp("recovery")
    cfg = load_config(
        None,
        [
            f"rollout.model_path={qwen3_dir}",
            "rollout.use_gpu=true",
            "rollout.num_engines=2",
            f"rollout.log_dir={out}/logs",
            "rollout.recovery_wait_s=60",
            "rollout.probe_interval_s=0.5",
            "rollout.probe_timeout_s=1",
            "rollout.probe_failures=2",
            "rollout.auto_restart=false",  # the tests drive restarts; the last one turns it on
            "weight_sync.transport=disk",
            f"weight_sync.path={out}/sync",
        ],
    )
    fleet = Fleet.from_config(cfg)
    yield fleet
    fleet.shutdown()
    ray.shutdown()
    shutil.rmtree(temp, ignore_errors=True)


def kill(fleet, engine_id):
    pid = ray.get(fleet.slots[engine_id].head.engine_pid.remote())
    os.killpg(pid, signal.SIGKILL)
    return time.monotonic()


def wait_state(fleet, engine_id, state, timeout=10.0):
    deadline = time.monotonic() + timeout
    while fleet.slots[engine_id].state.value != state and time.monotonic() < deadline:
        time.sleep(0.02)
    return fleet.slots[engine_id].state.value


def test_death_is_noticed_at_once_and_restore_waits_for_verified_weights(fleet, qwen3_dir, qwen3_dir_b):
    model = AutoModelForCausalLM.from_pretrained(qwen3_dir_b, dtype=torch.float32)
    fleet.sync_weights(ModuleSource(model), "v1", config_dir=qwen3_dir)  # disk: leaves a checkpoint for v1
    killed_at = kill(fleet, 1)
    assert wait_state(fleet, 1, "INACTIVE", timeout=2.0) == "INACTIVE"
    detected_in = time.monotonic() - killed_at
    assert detected_in < 2.0
    samples = fleet.generate(PROMPTS, sampling=GREEDY)  # served by engine 0 alone meanwhile
    assert {s.engine_id for s in samples} == {0}

    # restart without restoring: the engine comes back with dummy weights and must refuse traffic
    restarted = fleet.restart_inactive(restore=False)
    assert restarted == [1] and fleet.slots[1].state.value == "AWAITING_WEIGHTS"
    direct = httpx.post(fleet.slots[1].url + "/generate", json={"input_ids": [1, 2], "sampling_params": GREEDY})
    assert direct.status_code == 503 and "weights are not loaded" in direct.json()["message"]
    assert {s.engine_id for s in fleet.generate(PROMPTS, sampling=GREEDY)} == {0}  # still not routed to it

    fleet.update_weights_from_disk(fleet.checkpoint_for("v1"), "v1", engine_ids=[1])  # restore + verify
    assert fleet.slots[1].state.value == "ACTIVE" and fleet.slots[1].version == "v1"
    samples = fleet.generate(PROMPTS * 2, sampling=GREEDY)
    assert {s.engine_id for s in samples} == {0, 1}
    assert [s.output_ids for s in samples[:4]] == [reference_greedy(qwen3_dir_b, p, 6)[0] for p in PROMPTS]
    assert {s.weight_version for s in samples} == {"v1"}
    history = [(t.old.value, t.new.value) for t in fleet.slots[1].lifecycle.history]
    assert history[-4:] == [
        ("ACTIVE", "INACTIVE"),
        ("INACTIVE", "RECOVERING"),
        ("RECOVERING", "AWAITING_WEIGHTS"),
        ("AWAITING_WEIGHTS", "ACTIVE"),
    ]


def test_generate_waits_for_recovery_when_no_engine_is_active(fleet, qwen3_dir_b):
    for engine_id in (0, 1):
        kill(fleet, engine_id)
        assert wait_state(fleet, engine_id, "INACTIVE") == "INACTIVE"
    results = {}

    def generate():
        results["samples"] = fleet.generate(PROMPTS, sampling=GREEDY)

    waiting = threading.Thread(target=generate)
    waiting.start()
    waiting.join(timeout=1.0)
    assert waiting.is_alive()  # nothing ACTIVE: it waits instead of failing
    assert sorted(fleet.restart_inactive()) == [0, 1]  # restores v1 from the disk checkpoint and verifies
    waiting.join(timeout=60)
    samples = results["samples"]
    assert [(s.prompt_index, s.sample_index) for s in samples] == [(p, 0) for p in range(4)]
    assert [s.output_ids for s in samples] == [reference_greedy(qwen3_dir_b, p, 6)[0] for p in PROMPTS]
    assert {s.weight_version for s in samples} == {"v1"}


def test_a_hung_engine_is_caught_by_probes_and_both_restore_by_read_once_fan_out(fleet, qwen3_dir_b):
    pid = ray.get(fleet.slots[0].head.engine_pid.remote())
    os.killpg(pid, signal.SIGSTOP)  # hung: the process lives but answers nothing
    assert wait_state(fleet, 0, "INACTIVE", timeout=10) == "INACTIVE"
    assert "health probes failed" in fleet.slots[0].lifecycle.history[-1].why
    kill(fleet, 1)
    assert wait_state(fleet, 1, "INACTIVE") == "INACTIVE"
    assert sorted(fleet.restart_inactive()) == [0, 1]  # two engines: files read once, fanned out, verified
    assert [s.state.value for s in fleet.slots] == ["ACTIVE", "ACTIVE"]
    samples = fleet.generate(PROMPTS, sampling=GREEDY)
    assert [s.output_ids for s in samples] == [reference_greedy(qwen3_dir_b, p, 6)[0] for p in PROMPTS]


def test_background_restart_brings_a_dead_engine_back_without_being_asked(fleet, qwen3_dir_b):
    fleet.rollout.auto_restart = True
    try:
        kill(fleet, 1)
        assert wait_state(fleet, 1, "INACTIVE") == "INACTIVE"
        assert wait_state(fleet, 1, "ACTIVE", timeout=30) == "ACTIVE"  # restored from v1 and verified
    finally:
        fleet.rollout.auto_restart = False
    assert fleet.slots[1].version == "v1"
    samples = fleet.generate(PROMPTS * 2, sampling=GREEDY)
    assert {s.engine_id for s in samples} == {0, 1}


def test_a_late_restore_of_an_older_version_does_not_move_the_fleet_back(fleet, qwen3_dir):
    """The background restarter reads the fleet's version, restarts, restores that version; if the
    trainer pushed a newer one meanwhile, the restore's verification must not set the fleet back (the
    GRPO chaos test once served a step from the stale engine that way)."""
    model = AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype=torch.float32)
    fleet.sync_weights(ModuleSource(model), "v2", config_dir=qwen3_dir)
    older = fleet.checkpoint_for("v1")
    assert older is not None and fleet.version == "v2"
    fleet.restore(older, "v1", [1])  # what a restart that began before the v2 push finishes with
    assert fleet.version == "v2" and fleet.slots[1].version == "v1"
    samples = fleet.generate(PROMPTS * 2, sampling=GREEDY)
    assert {s.engine_id for s in samples} == {0} and {s.weight_version for s in samples} == {"v2"}
    fleet.sync_weights(ModuleSource(model), "v3", config_dir=qwen3_dir)  # the next push takes it along
    assert {s.engine_id for s in fleet.generate(PROMPTS * 2, sampling=GREEDY)} == {0, 1}
