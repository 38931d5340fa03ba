"""Projections fused into one product (engine/kv/fused_projections.py): the parameters stay the
modules' own, views of one buffer, so the engine's weight updates, fingerprints and the release and
resume of its storages reach the fused product. The GPU fast path fuses them (kv/paged.py
`fuse_fast_path`); here the runner is made to, on the CPU, where torch's silu and product serve."""

from __future__ import annotations

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, Qwen2Config

from rollfleet.engine.kv.fused_projections import fuse_projections
from rollfleet.engine.kv.qkv_kernel import FUSABLE
from rollfleet.engine.model import model as model_module
from rollfleet.engine.model.model import ModelRunner
from rollfleet.wire.fingerprint import fingerprints

IDS = torch.tensor([[5, 6, 7, 8, 9, 10, 11]])


def runner_of(model_dir, monkeypatch, fused: bool) -> ModelRunner:
    with monkeypatch.context() as patch:
        if fused:
            patch.setattr(model_module, "fuse_fast_path", lambda model, *args: fuse_projections(model, FUSABLE))
        return ModelRunner(model_dir)  # the dense path: a forward of the model as it is


@torch.no_grad()
def logits(runner: ModelRunner) -> torch.Tensor:
    return runner.model(IDS).logits


def test_a_fused_runner_serves_updates_and_release_and_resume_like_an_unfused_one(qwen3_dir, qwen3_dir_b, monkeypatch):
    plain, fused = runner_of(qwen3_dir, monkeypatch, False), runner_of(qwen3_dir, monkeypatch, True)
    layers = fused.model.config.num_hidden_layers
    attention = fused.model.model.layers[0].self_attn
    assert attention.q_proj.weight.untyped_storage().data_ptr() == attention.fused_qkv.untyped_storage().data_ptr()
    assert len(fused._storages) == len(plain._storages) - 3 * layers  # q/k/v share one, gate/up another
    assert fused._memory()["weight_bytes"] == plain._memory()["weight_bytes"]
    torch.testing.assert_close(logits(fused), logits(plain), atol=1e-5, rtol=1e-5)

    for runner in (plain, fused):  # a full update, then one tensor of a group
        runner.weights.from_disk(qwen3_dir_b)
    torch.testing.assert_close(logits(fused), logits(plain), atol=1e-5, rtol=1e-5)
    want = fingerprints(load_file(f"{qwen3_dir_b}/model.safetensors").items(), fused.dtype)
    fused.load_prints.forget()
    assert fused.weights_fingerprint(None, 4096) == want
    name = "model.layers.1.self_attn.k_proj.weight"
    new = torch.randn_like(fused.model.get_parameter(name))
    for runner in (plain, fused):
        runner.weights.apply(lambda: ({name: new}, False))
    rows = fused.model.model.layers[1].self_attn.fused_qkv_sizes
    assert torch.equal(fused.model.model.layers[1].self_attn.fused_qkv[rows[0] : rows[0] + rows[1]], new)
    torch.testing.assert_close(logits(fused), logits(plain), atol=1e-5, rtol=1e-5)

    fused.release_memory(["weights"])
    assert fused._memory()["weight_bytes"] == 0  # the fused buffers went too
    fused.resume_memory(["weights"])
    fused.weights.from_disk(qwen3_dir_b)
    plain.weights.from_disk(qwen3_dir_b)
    torch.testing.assert_close(logits(fused), logits(plain), atol=1e-5, rtol=1e-5)


def test_projections_with_biases_stay_apart():
    config = Qwen2Config(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config).eval()
    assert model.model.layers[0].self_attn.q_proj.bias is not None
    with torch.no_grad():
        want = model(IDS).logits
        assert fuse_projections(model, FUSABLE) == (0, 1)  # the MLP has none: fused
        torch.testing.assert_close(model(IDS).logits, want, atol=1e-5, rtol=1e-5)
    assert not hasattr(model.model.layers[0].self_attn, "fused_qkv")
