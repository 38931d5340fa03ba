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
from rollfleet.engine.lora.lora import linear_targets, why_not_targetable
from rollfleet.weights.adapter import LoraSource, save_adapter


def check_targets(lora: LoraTrainConfig, model_path: str | Path) -> None:
    """Every target names at least one nn.Linear of the model that an engine can serve an adapter on
    (its own weight: not tied, not fused experts). Built on the meta device: nothing is read."""
    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    params = dict(model.named_parameters(remove_duplicate=False))
    targetable = linear_targets(model, params)
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
    """The model as a peft model with a fresh adapter (B = 0: it starts as the base model), before sharding;
    A orthonormal where train.lora.a_init says so (torch's RNG, seeded by the trainer: every rank the same)."""
    from peft import get_peft_model  # imported here: peft takes seconds to import

    peft_model = get_peft_model(model, config.lora.peft_config())
    if config.lora.a_init == "orthonormal":
        with torch.no_grad():
            for name, param in peft_model.named_parameters():
                if ".lora_A." in name:
                    torch.nn.init.orthogonal_(param)  # rows orthonormal (columns where rank > in features)
    return peft_model


def param_groups(model: torch.nn.Module, config: TrainConfig) -> list[dict]:
    """The optimizer's groups: everything that trains at train.lr, except (LoRA with a_lr_scale != 1)
    the A matrices at train.lr * train.lora.a_lr_scale."""
    trained = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    if config.lora is None or config.lora.a_lr_scale == 1.0:  # one group: what a full run's state holds
        return [{"params": [p for _, p in trained]}]
    a_matrices = [p for name, p in trained if ".lora_A." in name]
    rest = [p for name, p in trained if ".lora_A." not in name]
    return [{"params": rest}, {"params": a_matrices, "lr": config.lr * config.lora.a_lr_scale}]


def save_adapter_dir(model: torch.nn.Module, path: str | Path, *, keep: bool) -> None:
    """A peft adapter directory (adapter_config.json, whose base_model_name_or_path names the base the
    trainer loaded, and adapter_model.safetensors). Every rank calls (the gathers are collective);
    the rank with `keep` writes."""
    source = LoraSource(model, keep=keep)
    tensors = list(source.named_tensors())
    if keep:
        save_adapter(tensors, source.config_dict(), path)
