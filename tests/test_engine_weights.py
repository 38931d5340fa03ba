"""Dummy start, readiness, disk updates (all or nothing), weight routes, release/resume (tp=1)."""

from __future__ import annotations

import shutil

import httpx
import pytest
import torch
from conftest import call, engine_server, reference_greedy
from safetensors.torch import load_file, save_file

from rollfleet.wire.client import EngineError

PROMPT = [4, 8, 15, 16, 23, 42]
GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}


@pytest.fixture(scope="module")
def started(qwen3_dir, tmp_path_factory):
    """The dummy server, and what it answered right after its start, before any test could load
    weights into it (the module's tests share it, in any order)."""
    with engine_server(qwen3_dir, tmp_path_factory.mktemp("logs"), load_format="dummy") as proc:
        yield proc, answers_before_weights(proc)


@pytest.fixture(scope="module")
def server(started):
    return started[0]


@pytest.fixture
def loaded(server, qwen3_dir):
    """The server holding qwen3_dir's weights (a test before may have released or replaced them)."""
    released = call(server, "get_server_info")["rollfleet_released_memory"]
    if released:  # exactly these: a resume of a tag not released is refused
        call(server, "resume_memory_occupation", released)
    call(server, "update_weights_from_disk", qwen3_dir, weight_version="loaded")
    return server


def answers_before_weights(proc) -> dict:
    try:
        call(proc, "generate", input_ids=PROMPT, sampling_params=GREEDY)
        refused = None
    except EngineError as exc:
        refused = (exc.status_code, exc.message)
    return {
        "/health": status(proc, "/health"),
        "/health_generate": status(proc, "/health_generate"),
        "generate": refused,
        "weights_ready": call(proc, "get_model_info")["weights_ready"],
    }


def status(proc, route):
    return httpx.get(proc.url + route, timeout=30).status_code


def copy_checkpoint(src: str, dst, edit=None):
    shutil.copytree(src, dst)
    if edit is not None:
        tensors = load_file(f"{dst}/model.safetensors")
        edit(tensors)
        save_file(tensors, f"{dst}/model.safetensors", metadata={"format": "pt"})
    return str(dst)


def test_dummy_server_is_up_but_not_ready(started):
    _, answers = started
    assert answers["/health"] == 200 and answers["/health_generate"] == 503
    assert answers["generate"] is not None, "a dummy server without weights generated"
    assert answers["generate"][0] == 503 and "weights are not loaded" in answers["generate"][1]
    assert answers["weights_ready"] is False


def test_update_from_disk_makes_it_ready_with_the_checkpoint_weights(server, qwen3_dir):
    out = call(server, "update_weights_from_disk", qwen3_dir, weight_version="v1")
    assert out["success"] is True
    assert status(server, "/health_generate") == 200
    gen = call(server, "generate", input_ids=PROMPT, sampling_params=GREEDY)
    assert gen["output_ids"] == reference_greedy(qwen3_dir, PROMPT, 8)[0]
    assert gen["meta_info"]["weight_version"] == "v1"
    assert call(server, "get_model_info")["weight_version"] == "v1"
    # SGLang's param[:5]: the first 5 rows
    expected = load_file(f"{qwen3_dir}/model.safetensors")["model.layers.1.mlp.up_proj.weight"][:5]
    got = call(server, "get_weights_by_name", "model.layers.1.mlp.up_proj.weight", truncate_size=5)
    assert torch.allclose(torch.tensor(got), expected)


def test_reload_from_other_checkpoint_changes_output(server, qwen3_dir, qwen3_dir_b):
    call(server, "update_weights_from_disk", qwen3_dir_b, weight_version="v2")
    gen = call(server, "generate", input_ids=PROMPT, sampling_params=GREEDY)
    assert gen["output_ids"] == reference_greedy(qwen3_dir_b, PROMPT, 8)[0]
    assert gen["meta_info"]["weight_version"] == "v2"
    call(server, "update_weights_from_disk", qwen3_dir, weight_version="v3")


def _bad_checkpoints(qwen3_dir, tmp):
    def wrong_shape(t):
        t["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(3, 3)

    def unknown(t):
        t["model.layers.0.mlp.not_a_weight"] = torch.zeros(2)

    def missing(t):
        del t["model.layers.1.input_layernorm.weight"]

    def integer(t):
        t["model.norm.weight"] = torch.zeros(64, dtype=torch.int64)

    corrupt = copy_checkpoint(qwen3_dir, tmp / "corrupt")
    with open(f"{corrupt}/model.safetensors", "r+b") as handle:
        handle.write(b"\xff" * 64)
    return [
        (copy_checkpoint(qwen3_dir, tmp / "shape", wrong_shape), "model.layers.0.self_attn.q_proj.weight"),
        (copy_checkpoint(qwen3_dir, tmp / "unknown", unknown), "model.layers.0.mlp.not_a_weight"),
        (copy_checkpoint(qwen3_dir, tmp / "missing", missing), "model.layers.1.input_layernorm.weight"),
        (copy_checkpoint(qwen3_dir, tmp / "int", integer), "model.norm.weight"),
        (corrupt, "model.safetensors"),
        (str(tmp / "does-not-exist"), "not a directory"),
    ]


def test_bad_updates_change_nothing(server, loaded, qwen3_dir, tmp_path):
    before = call(server, "shard_fingerprints")
    version = call(server, "get_model_info")["weight_version"]
    reference = call(server, "generate", input_ids=PROMPT, sampling_params=GREEDY)["output_ids"]
    for path, offender in _bad_checkpoints(qwen3_dir, tmp_path):
        with pytest.raises(EngineError) as err:
            call(server, "update_weights_from_disk", path, weight_version="bad")
        assert err.value.status_code == 400 and offender in err.value.message, err.value.message
        assert call(server, "shard_fingerprints") == before
        assert call(server, "get_model_info")["weight_version"] == version
    assert call(server, "generate", input_ids=PROMPT, sampling_params=GREEDY)["output_ids"] == reference


def test_version_info_and_cache_routes(server, loaded):
    assert call(server, "update_weight_version", "v9")["new_version"] == "v9"
    gen = call(server, "generate", input_ids=PROMPT, sampling_params={"max_new_tokens": 1})
    assert gen["meta_info"]["weight_version"] == "v9"
    info = call(server, "get_server_info")
    assert info["tp_size"] == 1 and info["load_format"] == "dummy" and info["weight_version"] == "v9"
    assert "Cache flushed" in call(server, "flush_cache")
    with pytest.raises(EngineError) as err:
        call(server, "get_weights_by_name", "no.such.weight")
    assert err.value.status_code == 400 and "no.such.weight" in err.value.message


def test_release_and_resume_memory(server, loaded, qwen3_dir):
    (before,) = call(server, "memory")
    assert call(server, "release_memory_occupation", ["weights", "kv_cache"]) is None  # SGLang's null body
    (rank0,) = call(server, "memory")
    assert before["weight_bytes"] > 0 and rank0["weight_bytes"] == 0
    assert status(server, "/health_generate") == 503
    with pytest.raises(EngineError) as err:
        call(server, "generate", input_ids=PROMPT, sampling_params=GREEDY)
    assert "weights are not loaded" in err.value.message
    with pytest.raises(EngineError) as err:  # a refused disk update leaves them released
        call(server, "update_weights_from_disk", "/nonexistent")
    assert call(server, "memory")[0]["weight_bytes"] == 0
    with pytest.raises(EngineError) as err:  # None is every tag, cuda_graph too: not released (SGLang's state)
        call(server, "resume_memory_occupation", None)
    assert "tag 'cuda_graph' is not currently released" in err.value.message
    assert call(server, "resume_memory_occupation", ["kv_cache", "weights"]) is None
    assert call(server, "memory")[0]["weight_bytes"] == before["weight_bytes"]
    assert status(server, "/health_generate") == 503  # without a host copy the contents are gone until a push
    call(server, "update_weights_from_disk", qwen3_dir, weight_version="v10")
    gen = call(server, "generate", input_ids=PROMPT, sampling_params=GREEDY)
    assert gen["output_ids"] == reference_greedy(qwen3_dir, PROMPT, 8)[0]
