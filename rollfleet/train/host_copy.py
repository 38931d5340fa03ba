"""Host copies of device tensors, in buffers reused across steps, and the copy ceiling they are
measured against.

A GPU trainer moves the same tensors to the host every step (colocated offload, recovery
snapshots). Allocating host memory each time costs more than the copy itself (pinned allocation
is a system call per tensor; pageable memory halves the copy's speed), so `HostBuffers` keeps one
buffer per name and allocates again only when a shape or dtype changes. On a GPU the buffers are
pinned and the copies are queued without waiting (`non_blocking`); `settle(device)` waits for all
of them at once. On CPU the same code runs with plain tensors and synchronous copies.
"""

from __future__ import annotations

import time

import torch


class HostBuffers:
    """One host tensor per name, reused while its shape and dtype stay the same."""

    def __init__(self, *, pin: bool):
        self.pin = pin
        self._buffers: dict[str, torch.Tensor] = {}
        self.allocations = 0  # buffers created so far (steady state: no new ones)

    def take(self, name: str, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        buffer = self._buffers.get(name)
        if buffer is None or buffer.shape != shape or buffer.dtype != dtype:
            buffer = torch.empty(shape, dtype=dtype, device="cpu", pin_memory=self.pin)
            self._buffers[name] = buffer
            self.allocations += 1
        return buffer

    def copy_in(self, name: str, tensor: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """`tensor` (cast to `dtype` on its own device first) into the buffer `name`; on a GPU the copy
        is only queued: call `settle` before reading the buffer."""
        if dtype is not None and tensor.dtype != dtype:
            tensor = tensor.to(dtype)
        buffer = self.take(name, tensor.shape, tensor.dtype)
        buffer.copy_(tensor, non_blocking=self.pin)
        return buffer

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())


def settle(device: torch.device) -> None:
    """Wait for every copy queued on `device` (nothing to wait for on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def pinned_copy_ceiling(
    nbytes: int, device: torch.device | str, *, chunk_bytes: int = 256 << 20, repeats: int = 3
) -> dict[str, float] | None:
    """GB/s of plain pinned host<->device copies moving `nbytes` each way on `device`, the fastest
    of `repeats` warm passes; None on CPU (there is no host<->device copy to bound).

    The bytes go as copies of one `chunk_bytes` buffer (enough for the copy engine's full speed),
    so measuring a 17 GB offload does not need 17 GB free on the GPU."""
    device = torch.device(device)
    if device.type != "cuda" or nbytes <= 0:
        return None
    size = min(nbytes, chunk_bytes)
    copies = -(-nbytes // size)
    host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(size, dtype=torch.uint8, device=device)
    dev.copy_(host, non_blocking=True)  # warm: the first copy pays the driver's set-up
    host.copy_(dev, non_blocking=True)
    torch.cuda.synchronize(device)

    def best(target: torch.Tensor, source: torch.Tensor) -> float:
        seconds = []
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(copies):
                target.copy_(source, non_blocking=True)
            torch.cuda.synchronize(device)
            seconds.append(time.perf_counter() - start)
        return size * copies / min(seconds) / 1e9

    h2d, d2h = best(dev, host), best(host, dev)
    return {"h2d_gbps": h2d, "d2h_gbps": d2h, "bytes": float(size * copies)}
