"""Tensor and expert parallel engines (tp=2 processes over gloo): same tokens as one process,
and each rank holds exactly the shard a fresh load would give it, after a reload from disk. The
servers are conftest's weight_servers, shared with test_engine_weight_routes."""

from __future__ import annotations

import shutil

import pytest
import torch
from conftest import call, reference_greedy
from safetensors.torch import load_file, save_file

from rollfleet.wire.client import EngineError

PROMPTS = [[4, 8, 15, 16, 23, 42], [7, 7]]
GREEDY = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}


def greedy(proc):
    return [o["output_ids"] for o in call(proc, "generate", input_ids=PROMPTS, sampling_params=GREEDY)]


def expected(model_dir):
    return [reference_greedy(model_dir, prompt, 10)[0] for prompt in PROMPTS]


def test_tp2_matches_one_process_and_reload_gives_the_fresh_load_shards(weight_servers, qwen3_dir, qwen3_dir_b):
    fresh = weight_servers["ref2"]  # started from qwen3_dir_b; no test changes it
    reloaded = weight_servers["tp2"]  # started from dummy weights
    assert greedy(fresh) == expected(qwen3_dir_b)
    call(reloaded, "update_weights_from_disk", qwen3_dir, weight_version="a")
    assert greedy(reloaded) == expected(qwen3_dir)
    call(reloaded, "update_weights_from_disk", qwen3_dir_b, weight_version="b")
    prints = call(reloaded, "shard_fingerprints")
    assert len(prints) == 2 and prints[0] != prints[1]  # two ranks, different shards
    assert prints == call(fresh, "shard_fingerprints")
    assert greedy(reloaded) == expected(qwen3_dir_b)


def test_tp2_ep2_serves_a_moe_and_reloads_per_expert_checkpoints(weight_servers, moe_dir, moe_dir_b, tmp_path):
    engine = weight_servers["moe"]  # started from moe_dir; test_engine_weight_routes loads others into it
    fresh = weight_servers["moe_ref"]  # started from moe_dir_b; no test changes it
    info = call(engine, "get_server_info")
    assert (info["tp_size"], info["ep_size"]) == (2, 2)
    assert info["disable_overlap_schedule"] is True  # the followers would need rank 0's draws (kv/overlap.py)
    assert greedy(fresh) == expected(moe_dir_b)  # a fresh tp=2 ep=2 load serves its checkpoint
    call(engine, "update_weights_from_disk", moe_dir, weight_version="a")
    assert greedy(engine) == expected(moe_dir)
    call(engine, "update_weights_from_disk", moe_dir_b, weight_version="b")
    assert greedy(engine) == expected(moe_dir_b)
    assert call(engine, "shard_fingerprints") == call(fresh, "shard_fingerprints")
    name = "model.layers.1.mlp.experts.3.up_proj.weight"  # per-expert checkpoint name
    got = call(engine, "get_weights_by_name", name, truncate_size=7)
    assert torch.allclose(torch.tensor(got), load_file(f"{moe_dir_b}/model.safetensors")[name][:7])
    # an incomplete expert group is refused on every rank, and nothing changes
    broken = tmp_path / "broken"
    shutil.copytree(moe_dir, broken)
    tensors = load_file(broken / "model.safetensors")
    del tensors["model.layers.0.mlp.experts.2.gate_proj.weight"]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    before = call(engine, "shard_fingerprints")
    with pytest.raises(EngineError) as err:
        call(engine, "update_weights_from_disk", str(broken))
    assert "model.layers.0.mlp.experts.2.gate_proj.weight" in err.value.message
    assert call(engine, "shard_fingerprints") == before
    assert greedy(engine) == expected(moe_dir_b)
