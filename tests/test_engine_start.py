"""Engine start: the start breakdown each engine logs and reports, and the dummy start that reads no
weight file (real engine processes, tp=1, tp=2, tp=2 + ep=2 MoE).

Dummy engines start on copies of the model directories whose safetensors files were removed, so
any read of a weight file fails their start. They must come up not ready, refuse weight reads,
and after a push of the checkpoint's tensors hold exactly the shards of a normal load and generate
what it generates (same tokens, same logprobs: the rotary buffers were computed, not left empty)."""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import pytest
import torch
from conftest import call, engine_servers, reference_greedy
from safetensors.torch import load_file

from rollfleet.wire.buckets import iter_buckets
from rollfleet.wire.client import EngineError
from rollfleet.wire.serialize import serialize

PROMPTS = [[4, 8, 15, 16, 23, 42], [7, 7]]
GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
ENGINE_PHASES = ("spawn", "imports", "model_code", "device_and_group", "model_build", "server_setup", "listening")


def without_weight_files(src: str, dst: Path) -> str:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    assert not list(dst.glob("*.safetensors")) and (dst / "config.json").exists()
    return str(dst)


@pytest.fixture(scope="module")
def engines(qwen3_dir, moe_dir, qwen3_server, weight_servers, tmp_path_factory):
    """The dummy starts made here, and normal loads lent by conftest (qwen3_dir at tp=1, qwen3_dir_b
    at tp=2: see normal_models), whose starts were made the same way."""
    scratch = tmp_path_factory.mktemp("start")
    bare, bare_moe = without_weight_files(qwen3_dir, scratch / "qwen3"), without_weight_files(moe_dir, scratch / "moe")
    plan = {
        "dummy1": (bare, {"load_format": "dummy", "extra": ["--random-seed", "3"]}),
        "dummy2": (bare, {"tp_size": 2, "load_format": "dummy"}),
        "dummy_moe": (bare_moe, {"tp_size": 2, "ep_size": 2, "load_format": "dummy"}),
    }
    with engine_servers(plan, scratch / "logs") as procs:
        BEFORE_WEIGHTS.update({key: answers_before_weights(proc) for key, proc in procs.items()})
        yield {**procs, "normal1": qwen3_server, "normal2": weight_servers["ref2"]}


BEFORE_WEIGHTS: dict[str, dict] = {}  # what each dummy engine answered right after its start, before any push


def answers_before_weights(proc) -> dict:
    reads = {}
    for method, args in [
        ("get_weights_by_name", ("model.norm.weight",)),
        ("shard_fingerprints", ()),
        ("weights_fingerprint", (None,)),
    ]:
        try:
            call(proc, method, *args)
            reads[method] = None
        except EngineError as exc:
            reads[method] = (exc.status_code, exc.message)
    return {
        "/health_generate": httpx.get(proc.url + "/health_generate", timeout=30).status_code,
        "weights_ready": call(proc, "get_model_info")["weights_ready"],
        "reads": reads,
    }


@pytest.fixture(scope="module")
def normal_models(qwen3_dir, qwen3_dir_b) -> dict[int, str]:
    """The checkpoint each normal load serves, by tp size (no test changes what they serve)."""
    return {1: qwen3_dir, 2: qwen3_dir_b}


def push_checkpoint(proc, model_dir: str, tp: int, version: str) -> None:
    """Every tensor of the checkpoint in one call (MoE experts of one layer must arrive together)."""
    buckets = list(iter_buckets(load_file(f"{model_dir}/model.safetensors").items(), 48 * 1024))
    payloads = [serialize([b.to_payload() for b in buckets]) for _ in range(tp)]
    call(proc, "update_weights_from_tensor", payloads, load_format="flattened_bucket", weight_version=version)


def generated(proc) -> list[dict]:
    out = call(proc, "generate", input_ids=PROMPTS, sampling_params=GREEDY, return_logprob=True)
    return [{"ids": o["output_ids"], "logprobs": o["meta_info"]["output_token_logprobs"]} for o in out]


def assert_consistent(breakdown: dict) -> None:
    phases, total = breakdown["phases"], breakdown["total_s"]  # (no sign check: the timer clamps each at 0)
    assert sum(phases.values()) <= total + 1e-3, (sum(phases.values()), total)
    assert sum(phases.values()) >= 0.95 * total  # the phases cover the start, no gap left out


def test_every_engine_reports_its_start_breakdown(engines):
    for key, proc in engines.items():
        breakdown = call(proc, "get_server_info")["start_breakdown"]
        assert set(ENGINE_PHASES) <= set(breakdown["phases"]), (key, breakdown)
        assert_consistent(breakdown)
        assert 0 < breakdown["total_s"] <= proc.up_after_s + 0.05, (key, breakdown["total_s"], proc.up_after_s)
        assert "engine start " in proc.log_path.read_text()  # the one line at start
    for key in ("dummy2", "dummy_moe", "normal2"):
        breakdown = call(engines[key], "get_server_info")["start_breakdown"]
        assert "followers_ready" in breakdown["phases"]
        (follower,) = breakdown["followers"]  # tp=2: one follower, with its own phases
        assert {"spawn", "imports", "device_and_group", "model_build"} <= set(follower)


def test_random_seed_is_accepted_and_said_to_be_ignored(engines):
    assert "--random-seed 3 is ignored" in engines["dummy1"].log_path.read_text()


@pytest.mark.parametrize("key", ["dummy1", "dummy2", "dummy_moe"])
def test_dummy_start_reads_no_weight_file_and_serves_nothing_before_weights(engines, key):
    answers = BEFORE_WEIGHTS[key]  # taken at the start: a test of the module may have pushed since
    assert answers["/health_generate"] == 503 and answers["weights_ready"] is False
    for method, refused in answers["reads"].items():
        assert refused is not None, f"{method} answered before any weights"
        assert refused[0] == 400 and "weights are not loaded" in refused[1], (method, refused)


@pytest.mark.parametrize("tp", [1, 2])
def test_dummy_start_then_push_equals_a_normal_load(engines, normal_models, tp):
    dummy, normal, model_dir = engines[f"dummy{tp}"], engines[f"normal{tp}"], normal_models[tp]
    push_checkpoint(dummy, model_dir, tp, "pushed")
    assert call(dummy, "get_model_info")["weights_ready"] is True
    assert call(dummy, "shard_fingerprints") == call(normal, "shard_fingerprints")
    got, want = generated(dummy), generated(normal)
    assert [g["ids"] for g in got] == [w["ids"] for w in want]
    # the weights are equal bit for bit (fingerprints above); a logprob's last bits depend on how the
    # engine batched the prompts (seen at tp=1 under load) and, at tp=2, on gloo's reduction order
    for g, w in zip(got, want):
        assert [lp for lp, _, _ in g["logprobs"]] == pytest.approx([lp for lp, _, _ in w["logprobs"]], abs=1e-5)
    assert [g["ids"] for g in generated(dummy)] == [reference_greedy(model_dir, p, 8)[0] for p in PROMPTS]


def test_dummy_moe_start_with_expert_parallel_then_push_equals_the_checkpoint(engines, moe_dir):
    engine = engines["dummy_moe"]
    push_checkpoint(engine, moe_dir, 2, "pushed")
    assert [g["ids"] for g in generated(engine)] == [reference_greedy(moe_dir, p, 8)[0] for p in PROMPTS]
    name = "model.layers.1.mlp.experts.3.up_proj.weight"
    expected = load_file(f"{moe_dir}/model.safetensors")[name][:7]  # the first rows, as SGLang answers
    assert torch.allclose(torch.tensor(call(engine, "get_weights_by_name", name, truncate_size=7)), expected)
