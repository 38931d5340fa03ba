"""The trainer of a LoRA run (train.lora), one gloo rank on CPU: only the adapter trains and sits in
the optimizer, the KL reference is the base with the adapter disabled (no second copy), the saved
model is a peft adapter directory on the base path, a resumed state continues the adapter; and the
config refuses what a LoRA run cannot do, naming the field and the fix."""

from __future__ import annotations

import json

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from test_trainer import make_batch
from transformers import AutoModelForCausalLM

from rollfleet.config import ConfigError, TrainConfig, load_config
from rollfleet.config.lora import LoraTrainConfig, engine_sync_spec
from rollfleet.tiny_models import make_tiny_model
from rollfleet.train.fsdp import PolicyTrainer
from rollfleet.train.loop import train
from rollfleet.train.lora import check_targets
from rollfleet.weights.transports.lora import LoraTransport

LORA = {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj"]}


def lora_trainer(model_dir, **overrides) -> PolicyTrainer:
    config = TrainConfig(**{"lr": 1e-2, "micro_batch_size": 4, "lora": LoraTrainConfig(**LORA), **overrides})
    return PolicyTrainer(model_dir, config)


def adapter(trainer: PolicyTrainer) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in trainer.weight_source().named_tensors()}


def base_logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_only_the_adapter_trains_and_the_reference_is_the_base(qwen3_dir, gloo_world_of_one):
    trainer = lora_trainer(qwen3_dir, kl_coef=0.1)
    assert trainer.ref_model is None  # no second copy of the model
    trained = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    names = {n for n, p in trainer.model.named_parameters() if id(p) in trained}
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names)
    frozen = {n: p.detach().full_tensor().clone() for n, p in trainer.model.named_parameters() if id(p) not in trained}
    before = adapter(trainer)
    assert set(before) == {
        f"base_model.model.model.layers.{i}.self_attn.{m}.lora_{h}.weight"
        for i in range(2)
        for m in ("q_proj", "v_proj")
        for h in "AB"
    }
    metrics = [trainer.train_step(make_batch(seed)) for seed in range(3)]
    after = adapter(trainer)
    assert all(not torch.equal(before[k], after[k]) for k in before if ".lora_B." in k)  # B starts at 0, moved
    assert all(
        torch.equal(p.detach().full_tensor(), frozen[n]) for n, p in trainer.model.named_parameters() if n in frozen
    )
    # the adapter changed the policy, the reference did not move: it is the base model
    assert metrics[0]["kl"] == pytest.approx(0.0, abs=1e-9) and metrics[-1]["kl"] > 0
    ids = torch.tensor([make_batch(0)[0]["prompt_ids"] + make_batch(0)[0]["output_ids"]])
    base = AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype=torch.float32)
    with trainer._reference() as reference:
        assert torch.allclose(base_logits(reference, ids), base_logits(base, ids), atol=1e-5)
    assert not torch.allclose(base_logits(trainer.model, ids), base_logits(base, ids), atol=1e-4)


def test_saved_adapter_and_resumed_state(qwen3_dir, gloo_world_of_one, tmp_path):
    trainer = lora_trainer(qwen3_dir)
    for seed in range(2):
        trainer.train_step(make_batch(seed))
    trainer.save_hf(tmp_path / "adapter")
    trainer.save_state(tmp_path / "state", {"step": 2})
    held = adapter(trainer)
    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert saved.keys() == held.keys() and all(torch.equal(saved[k], held[k]) for k in held)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(qwen3_dir) and config["r"] == 4
    # peft itself loads it onto the base, and it computes what the trainer's policy computes
    ids = torch.tensor([[4, 8, 15, 16, 23, 42]])
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(qwen3_dir), tmp_path / "adapter")
    assert torch.allclose(base_logits(loaded, ids), base_logits(trainer.model, ids), atol=1e-5)
    # the resumable state holds what trains, not the frozen base
    state_bytes = sum(f.stat().st_size for f in (tmp_path / "state").iterdir())
    base_bytes = sum(p.numel() * 4 for p in AutoModelForCausalLM.from_pretrained(qwen3_dir).parameters())
    assert state_bytes < base_bytes / 4
    resumed = lora_trainer(qwen3_dir)
    assert resumed.load_state(tmp_path / "state") == {"step": 2}
    assert all(torch.equal(a, held[k]) for k, a in adapter(resumed).items())
    # the optimizer state came back too: both take the same next step
    batch = make_batch(5)
    assert trainer.train_step(batch)["loss"] == pytest.approx(resumed.train_step(batch)["loss"])
    assert all(torch.equal(a, b) for a, b in zip(adapter(trainer).values(), adapter(resumed).values()))


def test_a_matrices_learn_at_their_share_of_the_lr(qwen3_dir, gloo_world_of_one):
    """LoRA+ (train.lora.a_lr_scale): A steps at lr * scale, B at lr. From the same init, two steps (A's
    gradient is 0 on the first, B being 0) leave B the same and move A by exactly the scale's share."""
    plain, scaled = (
        PolicyTrainer(qwen3_dir, TrainConfig(lr=1e-2, micro_batch_size=4, lora=LoraTrainConfig(**LORA, a_lr_scale=s)))
        for s in (1.0, 0.0625)
    )
    assert [g["lr"] for g in scaled.optimizer.param_groups] == [1e-2, 1e-2 * 0.0625]
    start = adapter(plain)
    assert all(torch.equal(a, start[k]) for k, a in adapter(scaled).items())
    for trainer in (plain, scaled):
        for seed in range(2):
            trainer.train_step(make_batch(seed))
    moved, moved_scaled = adapter(plain), adapter(scaled)
    for name in start:
        if ".lora_B." in name:
            assert torch.allclose(moved_scaled[name], moved[name], rtol=1e-5, atol=1e-7)
        else:
            step, step_scaled = moved[name] - start[name], moved_scaled[name] - start[name]
            assert step.abs().max() > 0
            assert torch.allclose(step_scaled, step * 0.0625, rtol=1e-3, atol=1e-9)


def test_orthonormal_a_init(qwen3_dir, gloo_world_of_one):
    """train.lora.a_init=orthonormal: every A's rows orthonormal (peft's default A is not), B still 0 (the
    adapter starts as the base model), the same A for the same train.seed (every rank draws the same)."""

    def a_matrices(trainer):
        return {k: v for k, v in adapter(trainer).items() if ".lora_A." in k}

    def eye_gap(a):  # rows orthonormal: A A^T = I
        return (a @ a.T - torch.eye(a.shape[0])).abs().max().item()

    ortho = lora_trainer(qwen3_dir, seed=3, lora=LoraTrainConfig(**LORA, a_init="orthonormal"))
    again = lora_trainer(qwen3_dir, seed=3, lora=LoraTrainConfig(**LORA, a_init="orthonormal"))
    default = lora_trainer(qwen3_dir, seed=3)
    assert all(eye_gap(a) < 1e-5 for a in a_matrices(ortho).values())
    assert all(eye_gap(a) > 0.1 for a in a_matrices(default).values())
    assert all(torch.equal(a, b) for a, b in zip(a_matrices(ortho).values(), a_matrices(again).values()))
    assert all(not b.any() for k, b in adapter(ortho).items() if ".lora_B." in k)
    ids = torch.tensor([make_batch(0)[0]["prompt_ids"]])
    base = AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype=torch.float32)
    assert torch.allclose(base_logits(ortho.model, ids), base_logits(base, ids), atol=1e-5)


def test_targets_checked_against_the_model(qwen3_dir, moe_dir, tmp_path):
    check_targets(LoraTrainConfig(target_modules=["q_proj", "down_proj"]), qwen3_dir)
    with pytest.raises(ConfigError, match=r"train\.lora\.target_modules=.*'qproj'.*no module of that name.*fix"):
        check_targets(LoraTrainConfig(target_modules=["qproj"]), qwen3_dir)
    with pytest.raises(ConfigError, match="fused MoE expert"):
        check_targets(LoraTrainConfig(target_modules=["experts"]), moe_dir)
    tied = make_tiny_model(tmp_path / "tied", "qwen3", seed=0, tie_word_embeddings=True)
    with pytest.raises(ConfigError, match="tied"):
        check_targets(LoraTrainConfig(target_modules=["lm_head"]), tied)


@pytest.mark.parametrize(
    "overrides, field, fix",
    [
        (["train.lora.rank=4"], "weight_sync.transport='disk'", "set weight_sync.transport=lora"),
        (["weight_sync.transport=lora", "train.lora.rank=128"], "train.lora.rank=128", "max_lora_rank"),
        (
            ["weight_sync.transport=lora", "train.lora.rank=4", "weight_sync.lora_target_modules=[q_proj]"],
            "train.lora.target_modules=",
            "add them to weight_sync.lora_target_modules",
        ),
        (
            [
                "weight_sync.transport=lora",
                "train.lora.rank=4",
                "rollout.placement=colocated",
                "rollout.release_weights=true",
            ],
            "rollout.release_weights=True",
            "set rollout.release_weights=false",
        ),
        (
            ["weight_sync.transport=lora", "train.lora.rank=4", "train.lora.a_init=kaiming"],
            "train.lora.a_init",
            "orthonormal",
        ),
        (
            ["weight_sync.transport=lora", "train.lora.rank=4", "grpo.recovery_checkpoint_every=1"],
            "grpo.recovery_checkpoint_every=1",
            "'auto' or 0",
        ),
    ],
)
def test_lora_run_config_refusals(overrides, field, fix):
    with pytest.raises(ConfigError) as err:
        load_config(None, ["rollout.model_path=m", *overrides])
    assert field in str(err.value) and fix in str(err.value)


def test_grpo_refuses_the_lora_transport_without_train_lora(qwen3_dir):
    cfg = load_config(None, [f"rollout.model_path={qwen3_dir}", "weight_sync.transport=lora"])  # a fleet may
    with pytest.raises(ConfigError, match=r"weight_sync.transport='lora'.*fix: set train.lora"):
        train(cfg)


def test_lora_run_config_accepted():
    cfg = load_config(
        None,
        ["rollout.model_path=m", "weight_sync.transport=lora", "train.lora.rank=4", "rollout.num_engines=1"],
    )
    assert cfg.train.lora.peft_config().r == 4
    assert cfg.recovery_snapshot_every == 0  # the adapter its syncs leave on disk restores, not a full snapshot


def test_engines_are_started_for_the_modules_the_trainer_trains():
    """An unset weight_sync.lora_target_modules becomes train.lora.target_modules in the engines' flags
    (SGLang needs them; the embedded engine reserves merge room for those weights only); a set one stays."""
    base = ["rollout.model_path=m", "weight_sync.transport=lora", "train.lora.target_modules=[q_proj, up_proj]"]
    flags = LoraTransport.server_args(engine_sync_spec(load_config(None, base)))
    assert flags[flags.index("--lora-target-modules") + 1 :] == ["q_proj", "up_proj"]
    wider = load_config(None, [*base, "weight_sync.lora_target_modules=[q_proj, v_proj, up_proj]"])
    assert engine_sync_spec(wider).lora_target_modules == ["q_proj", "v_proj", "up_proj"]
    full = load_config(None, ["rollout.model_path=m"])
    assert engine_sync_spec(full) is full.weight_sync
