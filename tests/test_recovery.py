"""Recovery on a real Ray fleet: a dead engine is noticed at once, restarted with dummy weights,
refuses generate until its weights are restored and verified, and generation waits for recovery
when no engine is ACTIVE."""

from __future__ import annotations

import os
import re
import shutil
import signal
import threading
from pathlib import Path

import httpx
import pytest
import ray
import torch
from conftest import FailsAfter, kill, reference_greedy, stop
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM
from waits import fleet_state, wait_until

from rollfleet.config import TensorSync, load_config
from rollfleet.fleet.fleet import Fleet
from rollfleet.weights.source import ModuleSource

GREEDY = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
PROMPTS = [[4, 8, 15], [16, 23, 42], [7, 7], [1, 2]]


@pytest.fixture(scope="module")
def fleet(local_ray, qwen3_dir, tmp_path_factory):
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
            "rollout.probe_timeout_s=2",  # a busy engine's /health on a loaded 2-core machine can pass 1 s
            "rollout.probe_failures=2",  # a hang is caught in about 5 s
            "rollout.restore_timeout_s=30",
            "rollout.auto_restart=false",  # the tests drive restarts; the last one turns it on
            "weight_sync.transport=disk",
            f"weight_sync.path={out}/sync",
        ],
    )
    fleet = Fleet.from_config(cfg)
    yield fleet
    fleet.shutdown()


_LABELS = iter(range(10**6))


def _serving(fleet, model_dir: str, kind: str, config_dir: str) -> str:
    """Both engines ACTIVE at a version holding `model_dir`'s weights with a checkpoint of it
    (labels `kind-N`), whatever a test before left: each test sets up the state it asserts on."""
    fleet.restart_inactive()
    serving = all(s.state.value == "ACTIVE" and s.version == fleet.version for s in fleet.slots)
    if serving and fleet.version.startswith(f"{kind}-") and fleet.checkpoint_for(fleet.version):
        return fleet.version
    version = f"{kind}-{next(_LABELS)}"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    report = fleet.sync_weights(ModuleSource(model), version, config_dir=config_dir)  # disk: leaves a checkpoint
    assert report.verified == [0, 1] and fleet.version == version, report
    return version


@pytest.fixture
def v1(fleet, qwen3_dir, qwen3_dir_b) -> str:
    """The fleet's version: qwen3_dir_b's weights on both engines, a checkpoint of them on disk."""
    return _serving(fleet, qwen3_dir_b, "b", qwen3_dir)


@pytest.fixture
def base(fleet, qwen3_dir) -> str:
    """The fleet's version: qwen3_dir's weights on both engines, a checkpoint of them on disk."""
    return _serving(fleet, qwen3_dir, "base", qwen3_dir)


def fail_a_push(fleet, model, engine_ids=None):
    """A push that fails part-way (several calls, some applied): its engines wait, out of rotation."""
    with pytest.raises(RuntimeError, match="part-way"):
        fleet.sync_weights(FailsAfter(model, 5), "partial", engine_ids=engine_ids, transport=TensorSync(bucket_mb=0.05))


def wait_state(fleet, engine_id, state):
    wait_until(
        lambda: fleet.slots[engine_id].state.value == state,
        what=f"engine {engine_id} {state} (history {fleet.slots[engine_id].lifecycle.history[-3:]})",
        state=lambda: fleet_state(fleet),
    )
    return fleet.slots[engine_id].state.value


def test_death_is_noticed_at_once_and_restore_waits_for_verified_weights(fleet, v1, qwen3_dir, qwen3_dir_b):
    kill(fleet, 1)
    assert wait_state(fleet, 1, "INACTIVE") == "INACTIVE"
    # noticed at once: by the death watch (or a request the router saw fail), not by the probes
    assert "process exited" in fleet.slots[1].lifecycle.history[-1].why
    samples = fleet.generate(PROMPTS, sampling=GREEDY)  # served by engine 0 alone meanwhile
    assert {s.engine_id for s in samples} == {0}

    # restart without restoring: the engine comes back with dummy weights and must refuse traffic
    restarted = fleet.restart_inactive(restore=False)
    assert restarted == [1] and fleet.slots[1].state.value == "AWAITING_WEIGHTS"
    direct = httpx.post(fleet.slots[1].url + "/generate", json={"input_ids": [1, 2], "sampling_params": GREEDY})
    assert direct.status_code == 503 and "weights are not loaded" in direct.json()["message"]
    assert {s.engine_id for s in fleet.generate(PROMPTS, sampling=GREEDY)} == {0}  # still not routed to it

    fleet.update_weights_from_disk(fleet.checkpoint_for(v1), v1, engine_ids=[1])  # restore + verify
    assert fleet.slots[1].state.value == "ACTIVE" and fleet.slots[1].version == v1
    samples = fleet.generate(PROMPTS * 2, sampling=GREEDY)
    assert {s.engine_id for s in samples} == {0, 1}
    assert [s.output_ids for s in samples[:4]] == [reference_greedy(qwen3_dir_b, p, 6)[0] for p in PROMPTS]
    assert {s.weight_version for s in samples} == {v1}
    history = [(t.old.value, t.new.value) for t in fleet.slots[1].lifecycle.history]
    assert history[-4:] == [
        ("ACTIVE", "INACTIVE"),
        ("INACTIVE", "RECOVERING"),
        ("RECOVERING", "AWAITING_WEIGHTS"),
        ("AWAITING_WEIGHTS", "ACTIVE"),
    ]


def test_generate_waits_for_recovery_when_no_engine_is_active(fleet, v1, qwen3_dir_b):
    for engine_id in (0, 1):
        kill(fleet, engine_id)
        assert wait_state(fleet, engine_id, "INACTIVE") == "INACTIVE"
    results = {}

    def generate():
        results["samples"] = fleet.generate(PROMPTS, sampling=GREEDY)

    waiting = threading.Thread(target=generate)
    retries = fleet.router.retries
    waiting.start()
    # nothing ACTIVE: the router holds the requests (no engine to try) instead of failing them
    wait_until(
        lambda: fleet.router.waiting_requests,
        what="requests waiting for an engine",
        alive=waiting.is_alive,
        state=lambda: fleet_state(fleet),
    )
    assert fleet.router.retries == retries and "samples" not in results
    assert sorted(fleet.restart_inactive()) == [0, 1]  # restores v1 from the disk checkpoint and verifies
    waiting.join(timeout=60)
    samples = results["samples"]
    assert [(s.prompt_index, s.sample_index) for s in samples] == [(p, 0) for p in range(4)]
    assert [s.output_ids for s in samples] == [reference_greedy(qwen3_dir_b, p, 6)[0] for p in PROMPTS]
    assert {s.weight_version for s in samples} == {v1}


def test_a_hung_engine_is_caught_by_probes_and_both_restore_from_the_checkpoint(fleet, v1, qwen3_dir_b):
    pid = ray.get(fleet.slots[0].head.engine_pid.remote())
    os.killpg(pid, signal.SIGSTOP)  # hung: the process lives but answers nothing
    assert wait_state(fleet, 0, "INACTIVE") == "INACTIVE"
    assert "health probes failed" in fleet.slots[0].lifecycle.history[-1].why
    kill(fleet, 1)
    assert wait_state(fleet, 1, "INACTIVE") == "INACTIVE"
    assert sorted(fleet.restart_inactive()) == [0, 1]  # no peer left: each reads the checkpoint, verified
    assert [s.state.value for s in fleet.slots] == ["ACTIVE", "ACTIVE"]
    samples = fleet.generate(PROMPTS, sampling=GREEDY)
    assert [s.output_ids for s in samples] == [reference_greedy(qwen3_dir_b, p, 6)[0] for p in PROMPTS]


def test_background_restart_brings_a_dead_engine_back_without_being_asked(fleet, v1, qwen3_dir_b):
    fleet.rollout.auto_restart = True
    try:
        mark = fleet.slots[1].lifecycle.mark()
        kill(fleet, 1)
        # the restart may begin within milliseconds of the death, and a peer restore is fast: wait for
        # ACTIVE after a failure, not for the INACTIVE state itself
        wait_until(
            lambda: fleet.slots[1].lifecycle.failed_since(mark) and fleet.slots[1].state.value == "ACTIVE",
            what=f"engine 1 back ({fleet.slots[1].lifecycle.history[mark:]})",
            state=lambda: fleet_state(fleet),
        )
    finally:
        fleet.rollout.auto_restart = False
    assert fleet.slots[1].version == v1
    samples = fleet.generate(PROMPTS * 2, sampling=GREEDY)
    # (seen once in many runs: every request went to engine 0; the slots' state says why next time)
    slots = [(s.engine_id, s.state.value, s.version, s.outstanding, s.lifecycle.history[-3:]) for s in fleet.slots]
    assert {s.engine_id for s in samples} == {0, 1}, slots


def restored_by(fleet, engine_id):
    """The source named by the engine's last verification ("verified at version 'v' (peer)")."""
    return fleet.slots[engine_id].lifecycle.history[-1].why.rsplit("(", 1)[-1].rstrip(")")


def test_a_restarted_engine_is_restored_from_its_peer_and_verified_against_the_seed(fleet, v1, qwen3_dir_b):
    kill(fleet, 1)
    assert wait_state(fleet, 1, "INACTIVE") == "INACTIVE"
    assert fleet.restart_inactive() == [1]
    assert fleet.slots[1].state.value == "ACTIVE" and restored_by(fleet, 1) == "peer"
    assert fleet.slots[1].version == v1 and [s.engine_id for s in fleet.recovery.peer.seeds(v1)] == [0, 1]
    seed_prints = fleet.pool.call(0, "weights_fingerprint", None)
    assert fleet.pool.call(1, "weights_fingerprint", None) == seed_prints
    samples = fleet.generate(PROMPTS * 2, sampling=GREEDY)
    assert {s.engine_id for s in samples} == {0, 1} and {s.weight_version for s in samples} == {v1}
    assert [s.output_ids for s in samples[4:]] == [reference_greedy(qwen3_dir_b, p, 6)[0] for p in PROMPTS]


def test_a_seed_killed_during_the_pull_fails_only_that_restore_and_the_checkpoint_follows(fleet, v1):
    kill(fleet, 1)
    assert wait_state(fleet, 1, "INACTIVE") == "INACTIVE"
    assert fleet.restart_inactive(restore=False) == [1]
    stop(fleet, 0)  # the seed hangs: the pull waits on it, then the seed is killed mid-pull
    restore = threading.Thread(target=fleet.restart_inactive)
    restore.start()
    wait_until(
        lambda: fleet.recovery.gate.phase == "restoring",
        what="the restore under way",
        alive=restore.is_alive,
        state=lambda: fleet_state(fleet),
    )
    kill(fleet, 0)
    restore.join()
    assert fleet.slots[1].state.value == "ACTIVE" and restored_by(fleet, 1) == "checkpoint"
    assert not any("not done in" in t.why for t in fleet.slots[1].lifecycle.history)  # the kill ended it
    assert ("peer", v1, fleet.slots[1].url) in fleet.recovery.failed_restores
    assert wait_state(fleet, 0, "INACTIVE") == "INACTIVE"
    assert fleet.restart_inactive() == [0]  # now engine 1 seeds engine 0
    assert fleet.slots[0].state.value == "ACTIVE" and restored_by(fleet, 0) == "peer"
    assert {s.engine_id for s in fleet.generate(PROMPTS * 2, sampling=GREEDY)} == {0, 1}


def test_a_late_restore_of_an_older_version_does_not_move_the_fleet_back(fleet, v1, qwen3_dir):
    """The background restarter reads the fleet's version, restarts, restores that version; if the
    trainer pushed a newer one meanwhile, the restore's verification must not set the fleet back (the
    GRPO chaos test once served a step from the stale engine that way)."""
    model = AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype=torch.float32)
    fleet.sync_weights(ModuleSource(model), "v2", config_dir=qwen3_dir)
    older = fleet.checkpoint_for(v1)
    assert older is not None and fleet.version == "v2"
    fleet.restore(older, v1, [1])  # what a restart that began before the v2 push finishes with
    assert fleet.version == "v2" and fleet.slots[1].version == v1
    samples = fleet.generate(PROMPTS * 2, sampling=GREEDY)
    assert {s.engine_id for s in samples} == {0} and {s.weight_version for s in samples} == {"v2"}
    fleet.sync_weights(ModuleSource(model), "v3", config_dir=qwen3_dir)  # the next push takes it along
    assert {s.engine_id for s in fleet.generate(PROMPTS * 2, sampling=GREEDY)} == {0, 1}


def test_a_failed_push_is_undone_by_a_restore_and_a_restore_past_its_timeout_gives_up(fleet, base, qwen3_dir):
    """Both engines hold part of a failed push (AWAITING_WEIGHTS, no traffic); engine 0 hangs during
    the restore and probes are off: the restore gives up at `restore_timeout_s`, kills the hung
    engine, and a colocated step waiting in `paused()` gets in then, not later. The next restart
    restores both from the checkpoint of the fleet's version, each verified."""
    model = AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype=torch.float32)
    version = fleet.version
    fail_a_push(fleet, model)
    assert [s.state.value for s in fleet.slots] == ["AWAITING_WEIGHTS"] * 2 and fleet.version == version
    probe_failures, restore_timeout_s = fleet.rollout.probe_failures, fleet.rollout.restore_timeout_s
    fleet.rollout.probe_failures, fleet.rollout.restore_timeout_s = 10**6, 2.0  # only the timeout catches it
    stop(fleet, 0)
    restore = threading.Thread(target=fleet.restart_inactive)
    try:
        restore.start()
        wait_until(
            lambda: fleet.recovery.gate.phase == "restoring",
            what="the restore",
            alive=restore.is_alive,
            state=lambda: fleet_state(fleet),
        )
        with fleet.recovery.paused():  # what a colocated step enters: it waits for the restore, bounded
            given_up = fleet.slots[0].lifecycle.history[-1].why  # it got in once the restore gave up
        restore.join()
    finally:
        fleet.rollout.probe_failures, fleet.rollout.restore_timeout_s = probe_failures, restore_timeout_s
    assert "not done in 2.0 s" in given_up, given_up
    assert fleet.slots[0].state.value == "INACTIVE" and "not done in 2.0 s" in fleet.slots[0].lifecycle.history[-1].why
    assert fleet.slots[1].state.value == "AWAITING_WEIGHTS"  # it answered: not killed, not blamed
    assert fleet.restart_inactive() == [0]
    assert [(s.state.value, s.version) for s in fleet.slots] == [("ACTIVE", version)] * 2
    samples = fleet.generate(PROMPTS * 2, sampling=GREEDY)
    assert {s.engine_id for s in samples} == {0, 1} and {s.weight_version for s in samples} == {version}
    assert [s.output_ids for s in samples[:4]] == [reference_greedy(qwen3_dir, p, 6)[0] for p in PROMPTS]


def test_probes_catch_an_engine_hung_during_a_restore_and_the_healthy_one_goes_active(fleet, base, qwen3_dir):
    model = AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype=torch.float32)
    fail_a_push(fleet, model)
    stop(fleet, 1)
    assert fleet.restart_inactive() == []  # nothing INACTIVE yet: both are restored from the checkpoint
    assert [s.state.value for s in fleet.slots] == ["ACTIVE", "INACTIVE"]
    whys = [t.why for t in fleet.slots[1].lifecycle.history[-2:]]
    assert any("health probes failed" in why for why in whys), whys  # the probes caught it, not the timeout
    assert not any("not done in" in why for why in whys), whys
    assert {s.engine_id for s in fleet.generate(PROMPTS * 2, sampling=GREEDY)} == {0}
    assert fleet.restart_inactive() == [1] and fleet.slots[1].state.value == "ACTIVE"


def test_a_corrupt_checkpoint_fails_its_restore_once_and_the_next_push_verifies(
    fleet, qwen3_dir, tmp_path, caplog, monkeypatch
):
    monkeypatch.setattr(fleet.recovery, "sources", fleet.recovery.sources[1:])  # no peer: the checkpoint first
    model = AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype=torch.float32)
    corrupt = tmp_path / "corrupt"
    shutil.copytree(fleet.checkpoint_for(fleet.version), corrupt)
    for shard in corrupt.glob("*.safetensors"):
        shard.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00not json")
    fleet.register_checkpoint(fleet.version, str(corrupt))  # what a restart now restores from
    fail_a_push(fleet, model, engine_ids=[1])
    mark = fleet.slots[1].lifecycle.mark()
    assert fleet.restart_inactive() == []  # the engine refuses the files; nothing raises
    assert fleet.slots[1].state.value == "AWAITING_WEIGHTS" and fleet.slots[1].lifecycle.since(mark) == []
    assert [r for r in caplog.records if "restore from checkpoint failed" in r.getMessage()]
    assert ("checkpoint", fleet.version, fleet.slots[1].url) in fleet.recovery.failed_restores
    caplog.clear()
    assert fleet.restart_inactive() == []
    assert not [r for r in caplog.records if "restore from checkpoint failed" in r.getMessage()]  # not tried again
    assert {s.engine_id for s in fleet.generate(PROMPTS * 2, sampling=GREEDY)} == {0}
    fleet.sync_weights(ModuleSource(model), "v4", config_dir=qwen3_dir)  # the next push takes it along
    assert [s.state.value for s in fleet.slots] == ["ACTIVE", "ACTIVE"]
    assert {s.engine_id for s in fleet.generate(PROMPTS * 2, sampling=GREEDY)} == {0, 1}


class TamperedCheckpoint:
    """A restore source that loads without error but delivers other weights than the version it
    claims: the engines read a copy of the version's checkpoint with one tensor changed, and the
    report says what the true checkpoint holds (a checkpoint registered under the wrong version, or
    one a disk changed under it)."""

    name = "tampered checkpoint"

    def __init__(self, fleet, true_dir: str, tampered_dir: str):
        self.fleet, self.true_dir, self.tampered_dir = fleet, true_dir, tampered_dir

    def available(self, version, slot) -> bool:
        return True

    def restore(self, slots, version, deadline):
        ids = [s.engine_id for s in slots]
        self.fleet.pool.on_all("update_weights_from_disk", ids, self.tampered_dir, weight_version=version)
        return self.fleet.expected_from_checkpoint(self.true_dir, version, ids)


def test_a_restore_that_delivers_other_weights_than_it_claims_is_not_served(
    fleet, v1, qwen3_dir, tmp_path, monkeypatch
):
    model = AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype=torch.float32)
    fleet.sync_weights(ModuleSource(model), "tamper", config_dir=qwen3_dir)  # disk: a checkpoint of it
    true_dir = fleet.checkpoint_for("tamper")
    tampered = tmp_path / "tampered"
    shutil.copytree(true_dir, tampered)
    (shard,) = tampered.glob("*.safetensors")
    tensors = load_file(shard)
    name = sorted(tensors)[0]
    tensors[name] = tensors[name] + 0.01  # one tensor changed; the files load as well as ever
    save_file(tensors, shard, metadata={"format": "pt"})
    sources = fleet.recovery.sources
    monkeypatch.setattr(fleet.recovery, "sources", [TamperedCheckpoint(fleet, true_dir, str(tampered)), *sources[1:]])
    fail_a_push(fleet, model, engine_ids=[1])
    mark = fleet.slots[1].lifecycle.mark()
    assert fleet.restart_inactive() == []  # the tampered load is refused, the true checkpoint follows
    assert ("tampered checkpoint", "tamper", fleet.slots[1].url) in fleet.recovery.failed_restores
    assert [t.new.value for t in fleet.slots[1].lifecycle.since(mark)] == ["ACTIVE"]
    assert restored_by(fleet, 1) == "checkpoint"
    assert fleet.pool.call(1, "weights_fingerprint", None) == fleet.pool.call(0, "weights_fingerprint", None)


def zygote_of(fleet, engine_id: int) -> int:
    """The pid of the zygote that forked the engine's last start (the launcher's log line)."""
    log = (Path(fleet.rollout.log_dir) / f"engine-{engine_id}.log").read_text()
    return int(re.findall(r"forked by zygote pid (\d+)", log)[-1])


def test_a_push_goes_on_while_an_engine_starts_and_the_engine_then_takes_its_version(fleet, v1, qwen3_dir_b):
    """A push waits for a restore, never for an engine start (an SGLang server takes a minute): with
    the background restart's start held (its zygote stopped), a push to the engine that serves
    completes; once the start goes on, the engine is restored to the pushed version from its peer."""
    zygote = zygote_of(fleet, 1)
    model = AutoModelForCausalLM.from_pretrained(qwen3_dir_b, dtype=torch.float32)
    fleet.rollout.auto_restart = True
    os.kill(zygote, signal.SIGSTOP)
    try:
        kill(fleet, 1)
        assert wait_state(fleet, 1, "RECOVERING") == "RECOVERING"
        report = fleet.sync_weights(ModuleSource(model), "v5", config_dir=fleet.rollout.model_path)
        assert report.verified == [0] and fleet.slots[1].state.value == "RECOVERING"
        os.kill(zygote, signal.SIGCONT)
        assert wait_state(fleet, 1, "ACTIVE") == "ACTIVE", fleet.slots[1].lifecycle.history[-3:]
    finally:
        os.kill(zygote, signal.SIGCONT)
        fleet.rollout.auto_restart = False
    assert fleet.slots[1].version == "v5" and restored_by(fleet, 1) == "peer"
    samples = fleet.generate(PROMPTS * 2, sampling=GREEDY)
    assert {s.engine_id for s in samples} == {0, 1} and {s.weight_version for s in samples} == {"v5"}
