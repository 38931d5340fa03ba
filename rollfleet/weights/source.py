"""Weight sources: anything that yields `(checkpoint_name, full_tensor)` pairs.

The trainer is one (an FSDP2 model: parameters are DTensors, `full_tensor()` is collective, so
every rank iterates in the same order and only the sending rank keeps the results); a plain
`nn.Module` is another. Names leave in HF checkpoint naming: MoE experts one by one, converted by
transformers' own mapping (rollfleet.wire.naming), one decoder layer at a time so every expert
of a fused parameter is converted together and memory stays bounded by about one layer.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Protocol

import torch
from torch.distributed.tensor import DTensor

from rollfleet.wire.naming import model_to_checkpoint, plain_names

_LAYER = re.compile(r"^(.*?\.layers\.\d+)\.")


class WeightSource(Protocol):
    def named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full tensors in checkpoint naming; every rank of a sharded source must call it together."""


def layer_key(name: str) -> str:
    """Tensors of one decoder layer share this key (fused MoE experts must travel together)."""
    match = _LAYER.match(name)
    return match.group(1) if match else name


class ModuleSource:
    """Full tensors of a (possibly FSDP2- or TP-sharded) transformers model."""

    def __init__(self, model: torch.nn.Module, *, keep: bool = True):
        self.model = model
        self.keep = keep  # False on ranks that take part in the gathers but do not send

    def named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        chunk: dict[str, torch.Tensor] = {}
        current = None
        for name, param in self.model.named_parameters():
            key = layer_key(name)
            if chunk and key != current:
                yield from self._convert(chunk)
                chunk = {}
            current = key
            full = param.full_tensor() if isinstance(param, DTensor) else param
            chunk[name] = full.detach()
        if chunk:
            yield from self._convert(chunk)

    def _convert(self, chunk: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
        if not self.keep:
            return
        plain = plain_names(self.model)  # pure renames skip transformers' conversion (computed once)
        rest = {}
        for name, tensor in chunk.items():
            if name in plain:
                yield plain[name], tensor
            else:
                rest[name] = tensor
        if rest:
            yield from model_to_checkpoint(self.model, rest).items()
