"""Colocated offload and onload of a trainer's parameters and optimizer state through host buffers
reused across steps.

Why not `model.to("cpu")`: it allocates fresh pageable host memory for every tensor every step and
copies one tensor at a time, synchronously. Here every copy goes into (or out of) a pinned buffer
that lives as long as the trainer, all copies are queued first and waited for once, and only then
are the module's parameters and the optimizer's state swapped to the moved tensors.

What moves and what stays: parameters (the FSDP shard of each rank) and the optimizer's tensors
move; module buffers (rotary tables: small, and the engines never need their memory) and AdamW's
`step` counters (already on the host) stay where they are. Gradients are None between steps
(`zero_grad(set_to_none=True)`), so none move.

Parameters are swapped with `Module._apply`, the mechanism `.to()` uses, so FSDP2 re-registers its
sharded parameters exactly as after `.to()`; a DTensor keeps its spec and only its local tensor
changes device.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from torch.distributed.tensor import DTensor

from rollfleet.train.host_copy import HostBuffers, settle


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def _like(tensor: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """`local` as the data of `tensor`: a DTensor with the same spec, or `local` itself."""
    if isinstance(tensor, DTensor):
        return DTensor(local, tensor._spec, requires_grad=False)
    return local


class Offloader:
    """Moves modules' parameters and an optimizer's state between `device` and host buffers.

    On a GPU the buffers are pinned; on CPU (tests, or a caller that wants the mechanics without a
    GPU) the same steps run with plain host tensors and synchronous copies."""

    def __init__(self, device: torch.device):
        self.device = device
        self.host = HostBuffers(pin=device.type == "cuda")

    def offload(self, modules: Sequence[torch.nn.Module], optimizer: torch.optim.Optimizer) -> dict:
        return self._move(modules, optimizer, to_host=True)

    def onload(self, modules: Sequence[torch.nn.Module], optimizer: torch.optim.Optimizer) -> dict:
        return self._move(modules, optimizer, to_host=False)

    def _move(self, modules: Sequence[torch.nn.Module], optimizer: torch.optim.Optimizer, *, to_host: bool) -> dict:
        """Queue every copy, wait once, then swap the moved tensors in. Returns bytes and seconds."""
        start, allocations = time.perf_counter(), self.host.allocations
        moved: dict[int, torch.Tensor] = {}  # id(parameter) -> its moved version
        nbytes = 0
        for index, module in enumerate(modules):
            for name, param in module.named_parameters():
                local = self._copy(f"model{index}.{name}", _local(param), to_host)
                moved[id(param)] = _like(param, local)
                nbytes += local.numel() * local.element_size()
        states = []
        for index, state in enumerate(optimizer.state.values()):
            for key, value in state.items():
                if key == "step" or not isinstance(value, torch.Tensor):
                    continue  # AdamW keeps `step` on the host
                local = self._copy(f"optim{index}.{key}", _local(value), to_host)
                states.append((state, key, _like(value, local)))
                nbytes += local.numel() * local.element_size()
        settle(self.device)  # every copy has landed before anything reads or frees its source
        for module in modules:
            # buffers come back unchanged; a tied weight is visited twice and gets the same tensor both times
            module._apply(lambda tensor: moved.get(id(tensor), tensor))
        for state, key, value in states:
            state[key] = value
        if to_host and self.device.type == "cuda":
            torch.cuda.empty_cache()  # give the freed memory back, for the engines
        return {
            "bytes": nbytes,
            "seconds": time.perf_counter() - start,
            "host_allocations": self.host.allocations - allocations,
        }

    def _copy(self, name: str, local: torch.Tensor, to_host: bool) -> torch.Tensor:
        if to_host:
            return self.host.copy_in(name, local)
        target = torch.empty(local.shape, dtype=local.dtype, device=self.device)
        target.copy_(local, non_blocking=self.host.pin)
        return target
