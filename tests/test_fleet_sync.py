"""What a fleet promises when things go wrong, on a real Ray fleet of two engines that require an API
key: a failed push takes every targeted engine out of rotation; a push that leaves a tensor out is not
verified and its engine serves nothing; a restart that fails leaves the engine INACTIVE and a later one
works; the router refuses cleanly (no engine: an error naming the states after the wait; a 4xx from
an engine: raised at once, not retried)."""

from __future__ import annotations

import shutil

import httpx
import pytest
import torch
from conftest import FailsAfter, reference_greedy, serving_again
from test_weight_sync import running_fleet
from transformers import AutoModelForCausalLM

from rollfleet.config import TensorSync
from rollfleet.fleet.fleet import WeightSyncError
from rollfleet.fleet.router import NoEngineAvailable
from rollfleet.weights.source import ModuleSource
from rollfleet.wire.client import EngineError

KEY = "fleet-test-key"
PROMPTS = [[4, 8, 15, 16], [7, 7], [1, 2, 3]]
GREEDY = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
SMALL_BUCKETS = TensorSync(bucket_mb=0.1)  # the tiny model takes several calls


@pytest.fixture(scope="module")
def model_dir(qwen3_dir, tmp_path_factory):
    """A copy of the tiny model of this module's own (a test moves it away to make a start fail)."""
    directory = tmp_path_factory.mktemp("model") / "qwen3"
    shutil.copytree(qwen3_dir, directory)
    return directory


@pytest.fixture(scope="module")
def fleet(local_ray, model_dir, tmp_path_factory):
    yield from running_fleet(
        model_dir,
        tmp_path_factory.mktemp("logs"),
        "rollout.num_engines=2",
        f"rollout.api_key={KEY}",
        "rollout.recovery_wait_s=1",
        "rollout.auto_restart=false",
        "rollout.restart_backoff_s=60",
    )


def states(fleet) -> list[str]:
    return [s.state.value for s in fleet.slots]


def model(path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


class LeavesOut:
    """A source that never sends one tensor."""

    def __init__(self, module, name: str):
        self.inner, self.name = ModuleSource(module), name

    def named_tensors(self):
        return ((n, t) for n, t in self.inner.named_tensors() if n != self.name)


@pytest.fixture
def serving(fleet, model_dir):
    """Both engines ACTIVE at the fleet's version, whatever a test before left."""
    serving_again(fleet, model(model_dir))
    return fleet


def test_a_fleet_with_an_api_key_generates_syncs_and_refuses_keyless_calls(fleet, serving, qwen3_dir_b):
    assert {s.engine_id for s in fleet.generate(PROMPTS * 2, sampling=GREEDY)} == {0, 1}
    report = fleet.sync_weights(ModuleSource(model(qwen3_dir_b)), "keyed", transport=SMALL_BUCKETS)
    assert report.verified == [0, 1] and fleet.version == "keyed"
    samples = fleet.generate(PROMPTS, sampling=GREEDY)
    assert [s.output_ids for s in samples] == [reference_greedy(qwen3_dir_b, p, 6)[0] for p in PROMPTS]
    direct = httpx.post(f"{fleet.slots[0].url}/generate", json={"input_ids": [1, 2], "sampling_params": GREEDY})
    assert direct.status_code == 401


def test_a_4xx_from_an_engine_is_raised_not_retried(fleet, serving):
    retries = fleet.router.retries
    with pytest.raises(EngineError) as err:
        fleet.generate(PROMPTS, sampling={"max_new_tokens": 4, "top_k": 0})  # an invalid top_k reaches the engine
    assert 400 <= err.value.status_code < 500
    assert fleet.router.retries == retries and states(fleet) == ["ACTIVE", "ACTIVE"]


def test_a_request_every_live_engine_fails_is_raised_after_one_try_each(fleet, serving, model_dir):
    """Engines answer 503 (their weights were released behind the fleet's back): the router tries
    each live engine once and raises the engine's error, instead of retrying without end."""
    fleet.pool.on_all("release_memory_occupation", [0, 1], ["weights"])
    retries = fleet.router.retries
    try:
        with pytest.raises(EngineError) as err:
            fleet.generate(PROMPTS[:1], sampling=GREEDY)
        assert err.value.status_code == 503
        assert fleet.router.retries - retries == 2  # one try on each engine, then raised (no retry without end)
        assert states(fleet) == ["ACTIVE", "ACTIVE"]  # a bad request takes no engine out
    finally:
        fleet.pool.on_all("resume_memory_occupation", [0, 1], ["weights"])
        fleet.update_weights_from_disk(str(model_dir), fleet.version)
    assert len(fleet.generate(PROMPTS, sampling=GREEDY)) == len(PROMPTS)


def test_a_push_that_fails_part_way_leaves_no_engine_serving(fleet, serving, model_dir, qwen3_dir_b):
    before = fleet.version
    with pytest.raises(RuntimeError, match="source failed part-way"):
        fleet.sync_weights(FailsAfter(model(model_dir), 5), "partial", transport=SMALL_BUCKETS)
    assert states(fleet) == ["AWAITING_WEIGHTS", "AWAITING_WEIGHTS"] and fleet.version == before
    assert [s.version for s in fleet.slots] == ["", ""]
    with pytest.raises(NoEngineAvailable) as err:  # nothing is served from half-replaced weights
        fleet.generate(PROMPTS, sampling=GREEDY)
    assert "no ACTIVE engine" in str(err.value) and "AWAITING_WEIGHTS" in str(err.value)
    assert "rollout.recovery_wait_s" in str(err.value)
    fleet.sync_weights(ModuleSource(model(qwen3_dir_b)), "whole", transport=SMALL_BUCKETS)  # a later push verifies
    assert states(fleet) == ["ACTIVE", "ACTIVE"]
    samples = fleet.generate(PROMPTS, sampling=GREEDY)
    assert [s.output_ids for s in samples] == [reference_greedy(qwen3_dir_b, p, 6)[0] for p in PROMPTS]
    assert {s.weight_version for s in samples} == {"whole"}


def test_a_push_missing_a_tensor_is_not_verified_and_not_served(fleet, serving, model_dir):
    left_out, before = "model.layers.0.mlp.down_proj.weight", fleet.version
    with pytest.raises((RuntimeError, EngineError)) as err:  # verification, or an engine's refused session end
        fleet.sync_weights(LeavesOut(model(model_dir), left_out), "incomplete", engine_ids=[1], transport=SMALL_BUCKETS)
    assert "engine 1" in str(err.value) or "end_weight_update" in str(err.value)
    assert fleet.slots[1].state.value != "ACTIVE" and fleet.slots[0].state.value == "ACTIVE"
    assert fleet.version == before  # nothing verified: the fleet stays where it was
    samples = fleet.generate(PROMPTS * 3, sampling=GREEDY)
    assert {s.engine_id for s in samples} == {0} and {s.weight_version for s in samples} == {before}


class ChangesUnderThePush:
    """A trainer that steps while its push is under way: once the last tensor went to the transport,
    every tensor is changed in place. The buckets already sent carry the values before; what the
    sender fingerprints is read after. Every call is accepted (a complete session): only the
    verification can tell the engine holds other weights than the push claims."""

    def __init__(self, module):
        self.inner = ModuleSource(module)

    def named_tensors(self):
        sent = []
        for name, tensor in self.inner.named_tensors():
            sent.append(tensor)
            yield name, tensor
        with torch.no_grad():
            for tensor in sent:
                tensor.add_(1.0)


def test_a_push_whose_tensors_change_under_it_is_not_verified_and_not_served(fleet, serving, model_dir):
    before = fleet.version
    with pytest.raises(WeightSyncError, match="engine 1"):
        fleet.sync_weights(ChangesUnderThePush(model(model_dir)), "moved", engine_ids=[1], transport=SMALL_BUCKETS)
    assert fleet.slots[1].state.value == "INACTIVE" and fleet.slots[0].state.value == "ACTIVE"
    assert "weights not verified" in fleet.slots[1].lifecycle.history[-1].why
    assert fleet.version == before  # nothing verified: the fleet stays where it was
    samples = fleet.generate(PROMPTS * 3, sampling=GREEDY)
    assert {s.engine_id for s in samples} == {0} and {s.weight_version for s in samples} == {before}


def test_a_verification_never_revives_an_engine_marked_failed_meanwhile(fleet, serving, qwen3_dir_b):
    """An engine marked INACTIVE while its weights were checked (here before the check: its process
    still runs and holds exactly the report's weights) stays INACTIVE, and the sync names it."""
    report = fleet.sync_weights(ModuleSource(model(qwen3_dir_b)), "checked", transport=SMALL_BUCKETS)
    assert states(fleet) == ["ACTIVE", "ACTIVE"]
    fleet.recovery.mark_dead(fleet.slots[1], "test: failed while it was verified")
    with pytest.raises(WeightSyncError, match=r"engine 1: it failed while it was verified \(now INACTIVE\)"):
        fleet.verify(report)
    assert states(fleet) == ["ACTIVE", "INACTIVE"] and report.verified == [0]


def test_a_restart_that_fails_leaves_the_engine_inactive_and_a_later_one_works(fleet, serving, model_dir, qwen3_dir_b):
    if fleet.slots[1].state.value != "INACTIVE":
        fleet.recovery.mark_dead(fleet.slots[1], "test: treat engine 1 as failed")
    moved = model_dir.with_name("qwen3-moved")
    model_dir.rename(moved)  # the engine's model directory is gone: its start fails
    try:
        assert fleet.restart_inactive() == []
    finally:
        moved.rename(model_dir)
    assert fleet.slots[1].state.value == "INACTIVE"
    assert fleet.slots[1].lifecycle.history[-1].why.startswith("restart failed")
    # a restart that did not bring the engine back is not tried again until its backoff passed
    wait = fleet.recovery.restart_wait_s(fleet.slots[1])
    assert 0 < wait <= fleet.rollout.restart_backoff_s
    tries = len(fleet.slots[1].lifecycle.history)
    assert fleet.restart_inactive(restore=False) == [] and len(fleet.slots[1].lifecycle.history) == tries
    assert fleet.restart_inactive(restore=False, force=True) == [1] and fleet.slots[1].state.value == "AWAITING_WEIGHTS"
    fleet.sync_weights(ModuleSource(model(qwen3_dir_b)), "after-restart", transport=SMALL_BUCKETS)
    assert states(fleet) == ["ACTIVE", "ACTIVE"]
    samples = fleet.generate(PROMPTS * 2, sampling=GREEDY)
    assert {s.engine_id for s in samples} == {0, 1}
    assert [s.output_ids for s in samples[:3]] == [reference_greedy(qwen3_dir_b, p, 6)[0] for p in PROMPTS]
