"""A parameter seen from one tp rank: its local shard, its full tensor, and a full tensor sliced to
the shard this rank holds (the same slices a fresh load gives it)."""

from __future__ import annotations

import hashlib

import torch
from torch.distributed.tensor import DTensor, distribute_tensor


def local_of(param: torch.Tensor) -> torch.Tensor:
    """The tensor object holding this rank's values (`to_local()` may return a fresh alias)."""
    return param._local_tensor if isinstance(param, DTensor) else param


def full_of(param: torch.Tensor) -> torch.Tensor:
    """The full tensor (a collective on DTensors: every rank calls it)."""
    return param.full_tensor() if isinstance(param, DTensor) else param.data


def shard_of(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """This rank's slice of `full`, cut locally (no rank talks to another)."""
    if isinstance(param, DTensor):
        return distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
    return full


def tensor_sha256(tensor: torch.Tensor) -> str:
    # a copy: numpy() on the parameter itself would pin its storage (no release/resume afterwards)
    data = tensor.detach().to("cpu", copy=True).contiguous().view(-1).view(torch.uint8)
    return hashlib.sha256(data.numpy()).hexdigest()
