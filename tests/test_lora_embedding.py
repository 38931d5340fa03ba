"""LoRA on the input embeddings (`embed_tokens`): peft's Embedding factors (`lora_embedding_A` [r, vocab]
starting at 0, `lora_embedding_B` [dim, r] random) merged by the embedded engine as scale * (B @ A).T give
peft's own forward, the base comes back bit for bit, and what cannot be served is refused naming the key,
the value and the fix: a tied embedding, wrong shapes or names, tp > 1. The trainer trains and sends the
factors only, with the random factor (the embedding's B) treated as a linear target's A."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file
from test_trainer import make_batch
from transformers import AutoModelForCausalLM

from rollfleet.config import ConfigError, TrainConfig, load_config
from rollfleet.config.lora import LoraTrainConfig
from rollfleet.engine.lora.lora import LoraError, LoraLimits, parse_adapter
from rollfleet.engine.lora.targets import lora_targets
from rollfleet.engine.model.model import ModelRunner
from rollfleet.tiny_models import make_tiny_model
from rollfleet.train.fsdp import PolicyTrainer
from rollfleet.train.lora import check_targets
from rollfleet.weights.adapter import LoraSource

EMBED_A = "base_model.model.model.embed_tokens.lora_embedding_A"
EMBED_B = "base_model.model.model.embed_tokens.lora_embedding_B"
TARGETS = ["embed_tokens", "q_proj", "lm_head"]
PROMPTS = [[4, 8, 15, 16, 23, 42], [7, 7, 9, 11, 300, 2]]


def embed_adapter(model_dir, targets=TARGETS, seed: int = 0, **config) -> PeftModel:
    """A peft adapter that changes the output: the factors peft starts at 0 (A of the embedding, B of the
    linear targets) drawn here."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(**{"r": 4, "lora_alpha": 8, "target_modules": targets, **config}))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if ".lora_B." in name or ".lora_embedding_A." in name:
                param.normal_(0, 0.05)
    return peft_model.eval()


def parse(model, tensors, config, limits=LoraLimits(), tp_size: int = 1):
    targetable = lora_targets(model, dict(model.named_parameters(remove_duplicate=False)), tp_size)
    return parse_adapter("p", "__tensor__", config, tensors, model, targetable, limits)


def test_the_engine_merges_an_embedding_adapter_as_peft_computes_it_and_restores_the_base(qwen3_dir, tmp_path):
    peft_model = embed_adapter(qwen3_dir)
    peft_model.save_pretrained(tmp_path / "embed", save_embedding_layers=False)
    runner = ModelRunner(qwen3_dir, lora=LoraLimits(target_modules=frozenset(TARGETS)))
    params = runner.lora._params
    base = {name: param.detach().clone() for name, param in params.items()}
    runner.lora.load("embed", str(tmp_path / "embed"))
    embedding = next(t for t in runner.lora.adapters["embed"].targets if t.embedding)
    layer = peft_model.base_model.model.model.embed_tokens
    assert embedding.scale == layer.scaling["default"] == 2.0
    assert torch.equal(embedding.delta(torch.device("cpu")), layer.get_delta_weight("default"))  # (B @ A).T * s
    ids = torch.tensor(PROMPTS)
    with torch.no_grad():
        want = peft_model(input_ids=ids).logits
        got = runner.prefill(PROMPTS, lora_name="embed", keep=ids.shape[1])
    runner.end_batch()
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    merged = params["model.embed_tokens.weight"]
    assert not torch.equal(merged, base["model.embed_tokens.weight"])
    assert torch.equal(merged, base["model.embed_tokens.weight"] + layer.get_delta_weight("default"))
    runner.lora.use(None)  # the base again, bit for bit: copied back, never subtracted
    assert all(torch.equal(param, base[name]) for name, param in params.items())
    with torch.no_grad():
        plain = AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype=torch.float32)(input_ids=ids).logits
    assert torch.allclose(runner.prefill(PROMPTS, keep=ids.shape[1]), plain, atol=1e-5)


def test_the_engine_reserves_room_for_the_embedding_it_may_merge(qwen3_dir):
    runner = ModelRunner(qwen3_dir, lora=LoraLimits(target_modules=frozenset({"q_proj", "embed_tokens"})))
    covered = [m.weight for n, m in runner.model.named_modules() if n.endswith(("q_proj", "embed_tokens"))]
    assert runner.lora.merge_bytes() == sum(w.nbytes for w in covered)
    assert "model.embed_tokens" in runner.lora.targetable


def test_embedding_adapters_the_engine_cannot_serve_are_refused_naming_the_key_and_the_fix(qwen3_dir, tmp_path):
    peft_model = embed_adapter(qwen3_dir)
    source = LoraSource(peft_model)
    config, good = source.config_dict(), dict(source.named_tensors())
    model = AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype=torch.float32)
    vocab, dim = model.get_input_embeddings().weight.shape
    assert parse(model, good, config).targets  # what the bad ones are made from is served
    cases = [
        ({**good, EMBED_A: torch.zeros(4, vocab - 1)}, f"{EMBED_A}: shape (4, {vocab - 1}), expected (r, {vocab})"),
        ({**good, EMBED_B: torch.zeros(dim + 1, 4)}, f"{EMBED_B}: shape ({dim + 1}, 4), expected ({dim}, 4)"),
        ({k: v for k, v in good.items() if k != EMBED_B}, "has no lora_embedding_B: every target needs both"),
        (  # the linear naming on an embedding (SGLang reads either; peft writes lora_embedding_*)
            {**{k: v for k, v in good.items() if "embed_tokens" not in k}, EMBED_A + "x": good[EMBED_A]},
            "not a LoRA weight",
        ),
        (
            {
                **{k: v for k, v in good.items() if "embed_tokens" not in k},
                "base_model.model.model.embed_tokens.lora_A.weight": good[EMBED_A],
                "base_model.model.model.embed_tokens.lora_B.weight": good[EMBED_B],
            },
            "an nn.Embedding target's factors are lora_embedding_A and lora_embedding_B",
        ),
        (  # peft's save_pretrained default keeps the base embedding beside the factors
            {**good, "base_model.model.model.embed_tokens.base_layer.weight": model.model.embed_tokens.weight},
            "save_embedding_layers=False",
        ),
    ]
    for tensors, offender in cases:
        with pytest.raises(LoraError, match="refused, nothing changed") as err:
            parse(model, tensors, config)
        assert offender in str(err.value), str(err.value)
    with pytest.raises(LoraError, match="'embed_tokens' is not in --lora-target-modules"):
        parse(model, good, config, LoraLimits(target_modules=frozenset({"q_proj", "lm_head"})))
    with pytest.raises(LoraError, match="served at tp 1 only .*--tp-size 1"):
        parse(model, good, config, tp_size=2)
    tied_dir = make_tiny_model(tmp_path / "tied", "qwen3", seed=0, tie_word_embeddings=True)
    tied = AutoModelForCausalLM.from_pretrained(tied_dir, dtype=torch.float32)
    tied_adapter = LoraSource(embed_adapter(tied_dir, ["embed_tokens", "q_proj"]))
    with pytest.raises(LoraError, match="embed_tokens' cannot be a LoRA target: its weight is tied to the output"):
        parse(tied, dict(tied_adapter.named_tensors()), tied_adapter.config_dict())


def test_the_trainer_trains_and_sends_only_the_embeddings_factors(qwen3_dir, gloo_world_of_one, tmp_path):
    """The random factor of the embedding is B (peft's roles swap): a_init orthonormal makes its columns
    orthonormal and a_lr_scale slows it, A starts at 0 (the adapter starts as the base) and learns at lr;
    what is sent and saved is the factors alone, under peft's keys, and peft loads it as trained."""
    lora = LoraTrainConfig(
        rank=4, alpha=8.0, target_modules=["embed_tokens", "q_proj"], a_init="orthonormal", a_lr_scale=0.25
    )
    trainer = PolicyTrainer(qwen3_dir, TrainConfig(lr=1e-2, micro_batch_size=4, lora=lora))
    start = {k: v.clone() for k, v in trainer.weight_source().named_tensors()}
    assert {k for k in start if "embed_tokens" in k} == {EMBED_A, EMBED_B}  # never the base embedding
    assert not start[EMBED_A].any() and torch.allclose(start[EMBED_B].T @ start[EMBED_B], torch.eye(4), atol=1e-5)
    slow = {id(p) for p in trainer.optimizer.param_groups[1]["params"]}
    assert trainer.optimizer.param_groups[1]["lr"] == 1e-2 * 0.25
    slow_factors = {n.split(".lora_")[1].split(".")[0] for n, p in trainer.model.named_parameters() if id(p) in slow}
    assert slow_factors == {"A", "embedding_B"}
    for seed in range(2):
        trainer.train_step(make_batch(seed))
    moved = dict(trainer.weight_source().named_tensors())
    assert moved[EMBED_A].abs().max() > 0 and not torch.equal(moved[EMBED_B], start[EMBED_B])
    trainer.save_hf(tmp_path / "adapter")
    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert saved.keys() == moved.keys() and all(torch.equal(saved[k], moved[k]) for k in saved)
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(qwen3_dir), tmp_path / "adapter")
    ids = torch.tensor(PROMPTS)
    with torch.no_grad():
        assert torch.allclose(loaded(input_ids=ids).logits, trainer.model(input_ids=ids).logits, atol=1e-5)


def test_an_embedding_target_is_refused_where_it_cannot_be_served(tmp_path):
    tied = make_tiny_model(tmp_path / "tied", "qwen3", seed=0, tie_word_embeddings=True)
    with pytest.raises(ConfigError, match=r"train\.lora\.target_modules=.*'embed_tokens'.*tied to the output.*fix"):
        check_targets(LoraTrainConfig(target_modules=["embed_tokens", "q_proj"]), tied)
    untied = make_tiny_model(tmp_path / "untied", "qwen3", seed=0)
    check_targets(LoraTrainConfig(target_modules=["embed_tokens", "q_proj"]), untied)
    lora = ["rollout.model_path=m", "weight_sync.transport=lora", "train.lora.target_modules=[embed_tokens,q_proj]"]
    with pytest.raises(ConfigError) as err:
        load_config(None, [*lora, "rollout.tp_size=2"])
    assert "train.lora.target_modules=" in str(err.value) and "rollout.tp_size=1" in str(err.value)
    targets = "train.lora.target_modules=[embed_tokens,q_proj,v_proj]"  # SGLang needs v beside q
    on_sglang = ["rollout.tp_size=2", "rollout.backend=sglang", targets]
    assert load_config(None, [*lora, *on_sglang]).rollout.tp_size == 2


def test_q_proj_without_v_proj_is_refused_for_sglang_engines():
    lora = ["rollout.model_path=m", "weight_sync.transport=lora", "train.lora.target_modules=[q_proj,o_proj]"]
    with pytest.raises(ConfigError) as err:
        load_config(None, [*lora, "rollout.backend=sglang"])
    assert "train.lora.target_modules=" in str(err.value) and "add v_proj" in str(err.value)
    assert load_config(None, lora).train.lora.target_modules == ["q_proj", "o_proj"]  # the embedded engine serves it
