"""Checkpoint (HF) names <-> a model's in-memory names, by transformers' own conversion mapping.

A checkpoint stores MoE experts one by one (`mlp.experts.3.up_proj.weight`); transformers fuses
them in memory (`mlp.experts.gate_up_proj` [E, 2I, H]). Weights cross rollfleet's boundaries in
checkpoint naming; these two functions move between the two forms with the same
`WeightConverter`/`WeightRenaming` rules `from_pretrained` and `save_pretrained` use.
"""

from __future__ import annotations

import weakref
from copy import deepcopy

import torch
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import (
    PrefixChange,
    WeightConverter,
    WeightRenaming,
    dot_natural_key,
    rename_source_key,
    revert_weight_conversion,
)


def _forward_transforms(model) -> list:
    transforms = getattr(model, "_weight_conversions", None)
    if transforms is None:
        transforms = get_model_conversion_mapping(model, add_legacy=False)
    return [t for t in transforms if not isinstance(t, PrefixChange)]


def checkpoint_to_model(model, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename and fuse checkpoint-named full tensors into the model's in-memory names.

    All tensors that fuse into one parameter (every expert of a layer) must be in `tensors`;
    a fused parameter that receives only some of its sources raises ValueError.
    """
    transforms = _forward_transforms(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    pattern_to_converter = {p: c for c in converters for p in c.source_patterns}
    pending: dict[str, object] = {}
    for name, tensor in sorted(tensors.items(), key=lambda kv: dot_natural_key(kv[0])):
        target, pattern = rename_source_key(name, renamings, converters)
        if pattern is None:
            pending.setdefault(target, WeightRenaming(name, target)).add_tensor(target, name, name, tensor)
        else:
            if target not in pending:
                pending[target] = deepcopy(pattern_to_converter[pattern])
            pending[target].add_tensor(target, name, pattern, tensor)
    out: dict[str, torch.Tensor] = {}
    for target, transform in pending.items():
        try:
            realized = transform.convert(target, model=model, config=model.config)
        except Exception as exc:  # transformers raises bare errors on incomplete groups
            raise ValueError(f"cannot build '{target}' from the given tensors: {exc}") from exc
        for key, value in realized.items():
            out[key] = value[0] if isinstance(value, list) else value
    return out


def model_to_checkpoint(model, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """In-memory names (fused experts) -> checkpoint names (one tensor per expert)."""
    return revert_weight_conversion(model, tensors)


_plain_cache: weakref.WeakKeyDictionary[torch.nn.Module, dict[str, str]] = weakref.WeakKeyDictionary()


def plain_names(model) -> dict[str, str]:
    """In-memory name -> checkpoint name for every parameter whose conversion is a pure rename:
    the checkpoint tensor IS the parameter (same values, same shape). Fused MoE experts and any
    other converted parameter are left out; they go through the conversion functions above.

    Computed once per model on meta tensors, so the per-sync path is a dict lookup per tensor."""
    cached = _plain_cache.get(model)
    if cached is not None:
        return cached
    transforms = _forward_transforms(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    out: dict[str, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        meta = torch.empty(param.shape, dtype=param.dtype, device="meta")
        converted = model_to_checkpoint(model, {name: meta})
        if len(converted) != 1:
            continue
        ((checkpoint_name, tensor),) = converted.items()
        target, pattern = rename_source_key(checkpoint_name, renamings, converters)
        if pattern is None and target == name and tuple(tensor.shape) == tuple(param.shape):
            out[name] = checkpoint_name
    _plain_cache[model] = out
    return out
