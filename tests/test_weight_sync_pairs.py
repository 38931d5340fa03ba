"""Weight sync for the other (model, tp) pairs: a dense Qwen3 into a tp=2 engine and a Qwen3-MoE
into a tp=1 engine (test_weight_sync.py covers dense into tp=1 and MoE into tp=2 ep=2). A module of
its own: its fleets need the fake GPUs the other module's fleets hold."""

from __future__ import annotations

import pytest
import torch
from conftest import reference_greedy
from test_weight_sync import PROMPTS, greedy, running_fleet, transport
from transformers import AutoModelForCausalLM

from rollfleet.weights.source import ModuleSource

# the test takes its fleet by name (request.getfixturevalue): this tells conftest that it runs on
# Ray, so the Ray of test_weight_sync, just before, carries on instead of a new one
pytestmark = pytest.mark.usefixtures("local_ray")


@pytest.fixture(scope="module")
def dense_tp2_fleet(local_ray, qwen3_dir, tmp_path_factory):
    yield from running_fleet(qwen3_dir, tmp_path_factory.mktemp("logs"), "rollout.tp_size=2")


@pytest.fixture(scope="module")
def moe_tp1_fleet(local_ray, moe_dir, tmp_path_factory):
    yield from running_fleet(moe_dir, tmp_path_factory.mktemp("logs"))


@pytest.mark.parametrize("name", ["tensor", "nccl", "disk"])
@pytest.mark.parametrize("kind", ["dense-tp2", "moe-tp1"])
def test_other_model_and_tp_pairs(request, kind, name, tmp_path):
    """The other two (model, tp) pairs: a dense Qwen3 into a tp=2 engine, a Qwen3-MoE into tp=1."""
    fleet = request.getfixturevalue("dense_tp2_fleet" if kind == "dense-tp2" else "moe_tp1_fleet")
    base, other = (
        (request.getfixturevalue("qwen3_dir"), request.getfixturevalue("qwen3_dir_b"))
        if kind == "dense-tp2"
        else (request.getfixturevalue("moe_dir"), request.getfixturevalue("moe_dir_b"))
    )
    for version, model_dir in ((f"{kind}-{name}-b", other), (f"{kind}-{name}-a", base)):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        options = {"config_dir": base} if name == "disk" else {}
        fleet.sync_weights(ModuleSource(model), version, transport=transport(name, tmp_path), **options)
        outputs, versions = greedy(fleet)
        assert versions == {version}
        assert outputs == [reference_greedy(model_dir, p, 8)[0] for p in PROMPTS]
