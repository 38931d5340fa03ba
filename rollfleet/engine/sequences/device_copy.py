"""Copies between the host and the device that do not wait for the device's queued work, so that the
host can prepare step t+1 while the device runs step t (kv/overlap.py).

A plain `tensor.to(device)` from pageable memory synchronizes the stream (PyTorch's
`memcpy_and_sync`): a step's inputs would wait for the step before it to end. From pinned memory the
copy is queued instead, and PyTorch's caching host allocator keeps the pinned buffer until the copy
is done. On a CPU both are plain tensors.
"""

from __future__ import annotations

import torch


def to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`torch.tensor(values)` on `device`, queued behind the device's work."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def to_host_soon(tensor: torch.Tensor) -> torch.Tensor:
    """A host copy of `tensor`, queued behind the device's work: read it once an event recorded
    after this call has completed (a CPU tensor is its own copy)."""
    if not tensor.is_cuda:
        return tensor
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return host.copy_(tensor, non_blocking=True)
