"""The trainer's side of a LoRA run (`train.lora`): the targets checked against the model, the
policy wrapped with peft before FSDP2 shards it, and the adapter saved in peft's layout.

Only the adapter's parameters require grad (peft freezes the base), so only they sit in the
optimizer and in the resumable state; the reference policy of the KL term is the same module with
the adapter disabled (`peft_model.disable_adapter()`), never a second copy of the base.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from rollfleet.config import ConfigError, TrainConfig
from rollfleet.config.lora import LoraTrainConfig
from rollfleet.engine.lora.targets import lora_targets, why_not_targetable
from rollfleet.weights.adapter import LoraSource, save_adapter


def check_targets(lora: LoraTrainConfig, model_path: str | Path) -> None:
    """Every target names at least one module of the model that an engine can serve an adapter on: an
    nn.Linear with its own weight (not tied, not fused experts), or an input embedding not tied to the
    output head. Built on the meta device: nothing is read."""
    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    params = dict(model.named_parameters(remove_duplicate=False))
    targetable = lora_targets(model, params)
    short_names = {path.rsplit(".", 1)[-1] for path in targetable}
    for target in lora.target_modules:
        if target in short_names:
            continue
        matches = [name for name, _ in model.named_modules() if name.rsplit(".", 1)[-1] == target]
        why = why_not_targetable(model, matches[0]) if matches else "the model has no module of that name"
        raise ConfigError(
            f"train.lora.target_modules={lora.target_modules!r}: {target!r} cannot take an adapter in "
            f"{type(model).__name__} ({why}) (fix: choose among {sorted(short_names)})"
        )


def wrap(model: torch.nn.Module, config: TrainConfig) -> torch.nn.Module:
    """The model as a peft model with a fresh adapter (the learning factor at 0: it starts as the base
    model), before sharding; the random factor orthonormal where train.lora.a_init says so (torch's RNG,
    seeded by the trainer: every rank the same)."""
    from peft import get_peft_model  # imported here: peft takes seconds to import

    peft_model = get_peft_model(model, config.lora.peft_config())
    if config.lora.a_init == "orthonormal":
        with torch.no_grad():
            for name, param in peft_model.named_parameters():
                if is_random_factor(name):  # rows orthonormal (columns where rank > in features)
                    torch.nn.init.orthogonal_(param)  # an embedding's B [dim, r]: its columns (rows where r > dim)
    return peft_model


def is_random_factor(name: str) -> bool:
    """Whether a peft parameter is the factor peft draws at random (the other starts at 0 and learns): a
    linear target's A; an embedding's B (peft's Embedding swaps the roles: A [r, num_embeddings] is 0,
    B [dim, r] normal), which stays the map of each token's code to the embedding's directions."""
    return ".lora_A." in name or ".lora_embedding_B." in name


def param_groups(model: torch.nn.Module, config: TrainConfig) -> list[dict]:
    """The optimizer's groups: everything that trains at train.lr, except (LoRA with a_lr_scale != 1)
    the random factors (`is_random_factor`: linear targets' A, an embedding's B) at train.lr * a_lr_scale."""
    trained = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    if config.lora is None or config.lora.a_lr_scale == 1.0:  # one group: what a full run's state holds
        return [{"params": [p for _, p in trained]}]
    random = [p for name, p in trained if is_random_factor(name)]
    rest = [p for name, p in trained if not is_random_factor(name)]
    return [{"params": rest}, {"params": random, "lr": config.lr * config.lora.a_lr_scale}]


def save_adapter_dir(model: torch.nn.Module, path: str | Path, *, keep: bool) -> None:
    """A peft adapter directory (adapter_config.json, whose base_model_name_or_path names the base the
    trainer loaded, and adapter_model.safetensors). Every rank calls (the gathers are collective);
    the rank with `keep` writes."""
    source = LoraSource(model, keep=keep)
    tensors = list(source.named_tensors())
    if keep:
        save_adapter(tensors, source.config_dict(), path)
