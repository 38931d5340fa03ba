"""Two reusable flat byte buffers a sender packs calls into, alternately: call k+1 is packed while
call k is in flight, and the sender's extra memory stays at two buckets whatever the model size.

The tensor transport makes them per sync (a colocated trainer holds nothing between syncs); the
nccl transport keeps them while connected (NCCL releases a broadcast's tensors late)."""

from __future__ import annotations

from concurrent.futures import Future

import torch

from rollfleet.wire.buckets import Bucket, FlattenedTensorMetadata

ALIGN = 64  # bytes: every dtype view of a slice starts aligned


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


class DoubleBuffer:
    def __init__(self, bucket_bytes: int):
        self.bucket_bytes = bucket_bytes
        self._buffers: list[torch.Tensor | None] = [None, None]

    def take(self, slot: int, nbytes: int, device: torch.device) -> torch.Tensor:
        """A 1-D uint8 tensor of at least `nbytes` on `device` from buffer `slot % 2` (a fresh one
        when the call is larger than a bucket: a decoder layer bigger than bucket_mb travels alone)."""
        if nbytes > self.bucket_bytes:
            return torch.empty(nbytes, dtype=torch.uint8, device=device)
        slot %= 2
        buffer, device = self._buffers[slot], torch.device(device)
        if device.type == "cuda" and device.index is None:  # "cuda" never equals a tensor's "cuda:0"
            device = torch.device("cuda", torch.cuda.current_device())
        if buffer is None or buffer.device != device or buffer.numel() < nbytes:
            # A whole bucket on a GPU: growing would leave the old buffer alive under an unfinished
            # transfer (three buffers). On the CPU, sized to the call and grown when needed: the first
            # send of a CPU buffer moves it into shared memory, a cost paid per byte.
            size = self.bucket_bytes if device.type == "cuda" else nbytes
            self._buffers[slot] = None
            buffer = self._buffers[slot] = torch.empty(size, dtype=torch.uint8, device=device)
        return buffer


class InFlight:
    """Calls still in flight (oldest first), each some futures (or torch Works).

    `make_room()` waits for the oldest while `depth` are in flight (its buffer is about to be reused);
    `drain()` waits for all; on an error it still waits for the rest, so no transfer is left half
    done behind the raised error."""

    def __init__(self, depth: int = 2):
        self.depth, self.calls = depth, []

    def add(self, *waitables, keep=None) -> None:
        """`keep`: what must stay alive until the call is finished (tensors whose handles were sent)."""
        self.calls.append((waitables, keep))

    def make_room(self) -> None:
        while len(self.calls) >= self.depth:
            self._finish(self.calls.pop(0)[0])

    def drain(self) -> None:
        errors = [wait_all(*waitables) for waitables, _ in self.calls]  # every call, even after an error
        self.calls = []
        error = next((e for e in errors if e is not None), None)
        if error is not None:
            raise error

    @staticmethod
    def _finish(waitables) -> None:
        error = wait_all(*waitables)
        if error is not None:
            raise error


def wait_all(*waitables) -> Exception | None:
    """Wait for every future (its answer) or torch Work (its transfer), None ones skipped; a failure
    does not stop the waits for the others. Returns the first error."""
    error = None
    for item in waitables:
        if item is None:
            continue
        try:
            item.result() if isinstance(item, Future) else item.wait()
        except Exception as exc:  # noqa: BLE001  (reported to the caller)
            error = error or exc
    return error


def call_bytes(call: list[tuple[str, torch.Tensor]]) -> int:
    return sum(_aligned(t.numel() * t.element_size()) for _, t in call)


def pack_bytes(call: list[tuple[str, torch.Tensor]], buffer: torch.Tensor) -> torch.Tensor:
    """Every tensor's bytes back to back (no padding) in `buffer`; returns the filled prefix."""
    parts = [t.detach().to(buffer.device).reshape(-1).view(torch.uint8) for _, t in call]
    total = sum(p.numel() for p in parts)
    flat = buffer[:total]
    torch.cat(parts, out=flat)
    return flat


def aligned_order(call: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """The call's tensors by element size, largest first (stable), so that packed back to back each
    starts at a multiple of its element size: SGLang sizes its receive bucket from the announced
    names, dtypes and shapes without padding and refuses an unaligned tensor."""
    return sorted(call, key=lambda item: -item[1].element_size())


def pack_call(call: list[tuple[str, torch.Tensor]], buffer: torch.Tensor) -> Bucket:
    """The whole call as ONE bucket in SGLang's byte form (its `FlattenedTensorBucket`,
    `supports_multi_dtypes`): a uint8 tensor, each tensor's bytes at an ALIGN-aligned offset, and
    metadata in bytes. SGLang reads one `{"flattened_tensor", "metadata"}` dict per tp rank's entry
    (`payload["flattened_tensor"]`); a list of buckets there is a TypeError its scheduler does not catch."""
    metadata, offset = [], 0
    for name, tensor in call:
        nbytes = tensor.numel() * tensor.element_size()
        target = buffer[offset : offset + nbytes]
        target.copy_(tensor.detach().reshape(-1).view(torch.uint8))
        metadata.append(
            FlattenedTensorMetadata(name, tuple(tensor.shape), tensor.dtype, offset, offset + nbytes, nbytes)
        )
        offset += _aligned(nbytes)
    return Bucket(buffer[:offset], metadata)


def pack_buckets(call: list[tuple[str, torch.Tensor]], buffer: torch.Tensor) -> list[Bucket]:
    """One bucket per dtype of the call, packed into aligned slices of `buffer`."""
    by_dtype: dict[torch.dtype, list[tuple[str, torch.Tensor]]] = {}
    for name, tensor in call:
        by_dtype.setdefault(tensor.dtype, []).append((name, tensor))
    buckets, offset = [], 0
    for dtype, members in by_dtype.items():
        numel = sum(t.numel() for _, t in members)
        flat = buffer[offset : offset + numel * dtype.itemsize].view(dtype)
        buckets.append(Bucket.pack(members, out=flat))
        offset += _aligned(numel * dtype.itemsize)
    return buckets
