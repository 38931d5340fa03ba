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

The freed memory goes back to the device in `give_back`, which ends the trainer's colocated turn
whether or not it offloaded: without it the CUDA caching allocator keeps every block the step and the
push freed (activations, logits, gather buffers) for the trainer's process, out of the engines' reach.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

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


def give_back(device: torch.device, work: Callable[[], dict]) -> dict:
    """`work()` (an offload, or nothing to move), then the cached memory given back to the device
    (torch.cuda.empty_cache); work's answer with `memory`: this process's allocated and reserved bytes
    on `device` before `work` and after the give-back. On CPU there is no cache: the figures are None."""
    allocated_before, reserved_before = _memory(device)
    answer = work()
    if device.type == "cuda":
        # buffers sent through CUDA IPC (the tensor transport's buckets) wait in torch's "limbo" until
        # their receivers let go, and return to the allocator only at a collection: collected here,
        # the engines having dropped them at the sync's end
        torch.cuda.ipc_collect()
        torch.cuda.empty_cache()
    allocated_after, reserved_after = _memory(device)
    memory = {
        "allocated_before": allocated_before,
        "reserved_before": reserved_before,
        "allocated_after": allocated_after,
        "reserved_after": reserved_after,
    }
    return {**answer, "memory": memory}


def _memory(device: torch.device) -> tuple[int | None, int | None]:
    if device.type != "cuda":
        return None, None
    return torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
