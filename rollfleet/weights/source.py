"""Weight sources: anything that yields `(checkpoint_name, full_tensor)` pairs.

The trainer is one (an FSDP2 model: parameters are DTensors, gathering is collective, so every
rank iterates in the same order and only the sending rank keeps the results); a plain
`nn.Module` is another. Names leave in HF checkpoint naming: MoE experts one by one, converted by
transformers' own mapping (rollfleet.wire.naming), one decoder layer at a time so every expert
of a fused parameter is converted together.

Two things keep a push cheap (rollfleet.weights.gather):
- `dtype`: every floating tensor is cast to the engines' dtype on the sender, BEFORE it is
  gathered, so a trainer with fp32 master weights moves half the bytes to bf16 engines. The
  fingerprints are defined on values in the engine's dtype, so they are the same either way.
  A sender that copies every tensor anyway (the tensor transport, into its buckets) asks for them
  uncast where no gather needs it (`named_tensors(cast=False)`) and casts as it copies.
- FSDP2 shards are gathered many at a time: one all-gather of a flat buffer per ~`gather_bytes`
  (whole decoder layers) instead of one `full_tensor()` per parameter (about 270 collectives for a
  1.5B model, 0.2 s of a 0.24 s push on 2 x H200).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Protocol

import torch
from torch.distributed.tensor import DTensor

from rollfleet.weights.gather import ShardGather, default_gather_bytes
from rollfleet.wire.naming import model_to_checkpoint, plain_names

_LAYER = re.compile(r"^(.*?\.layers\.\d+)\.")


class WeightSource(Protocol):
    def named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full tensors in checkpoint naming; every rank of a sharded source must call it together."""


def _local(param: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a parameter (the engine has its own, engine/tp/shards.local_of: the
    layers keep weights/ from importing the engine)."""
    return param._local_tensor if isinstance(param, DTensor) else param


def layer_key(name: str) -> str:
    """Tensors of one decoder layer share this key (fused MoE experts must travel together)."""
    match = _LAYER.match(name)
    return match.group(1) if match else name


class ModuleSource:
    """Full tensors of a (possibly FSDP2- or TP-sharded) transformers model.

    `keep`: False on ranks that take part in the gathers but do not send. `dtype`: the engines'
    dtype (None: the model's own). `gather_bytes`: about how many gathered bytes one all-gather
    carries (whole layers; a larger layer goes alone; default: by the parameters' device, see
    rollfleet.weights.gather.GATHER_BYTES). `stays`: the parameters' storages stay where they are
    between pushes (nothing offloads or replaces them), so engines may keep them mapped
    (rollfleet.weights.transports.resident)."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        keep: bool = True,
        dtype: torch.dtype | None = None,
        gather_bytes: int | None = None,
        stays: bool = False,
    ):
        self.model, self.keep, self.dtype, self.stays = model, keep, dtype, stays
        first = next(model.parameters(), None)
        device = first.device if first is not None else torch.device("cpu")
        self.gather_bytes = default_gather_bytes(device) if gather_bytes is None else gather_bytes

    def named_tensors(self, *, cast: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """`cast=False`: tensors that need no collective come in their own dtype, for a caller that
        casts them to `self.dtype` as it copies them (rollfleet.weights.gather.ShardGather's
        `defer_cast`); gathered ones are cast before their gather either way."""
        gather = ShardGather(self.dtype, keep=self.keep, defer_cast=not cast)
        for group in self._layer_groups():
            for chunk in gather.full_tensors(group):
                yield from self._convert(chunk)

    def parameter_storages(self) -> set[int]:
        """The addresses of the storages holding this rank's parameters (their local shards)."""
        return {_local(p).untyped_storage().data_ptr() for p in self.model.parameters()}

    def parameter_layout(self) -> tuple:
        """Where each of this rank's parameters lies (address, shape, stride, dtype): the same layout
        of the same model yields the same tensors (views of the same memory)."""
        return tuple((t.data_ptr(), t.shape, t.stride(), t.dtype) for t in map(_local, self.model.parameters()))

    def _layer_groups(self) -> Iterator[list[dict[str, torch.Tensor]]]:
        """Whole decoder layers (name -> parameter), grouped up to about `gather_bytes` gathered."""
        group: list[dict[str, torch.Tensor]] = []
        size = 0
        for layer in self._layers():
            layer_size = sum(ShardGather.gathered_bytes(p, self.dtype) for p in layer.values())
            if group and size + layer_size > self.gather_bytes:
                yield group
                group, size = [], 0
            group.append(layer)
            size += layer_size
        if group:
            yield group

    def _layers(self) -> Iterator[dict[str, torch.Tensor]]:
        chunk: dict[str, torch.Tensor] = {}
        current = None
        for name, param in self.model.named_parameters():
            key = layer_key(name)
            if chunk and key != current:
                yield chunk
                chunk = {}
            current = key
            chunk[name] = param
        if chunk:
            yield chunk

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
