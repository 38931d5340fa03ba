"""Two reusable flat byte buffers a sender packs calls into, alternately: call k+1 is packed while
call k is in flight, and the sender's extra memory stays at two buckets whatever the model size.

The tensor transport makes them per sync (a colocated trainer holds nothing between syncs); the
nccl transport keeps them while connected (NCCL releases a broadcast's tensors late).

A call's layout (names, shapes, dtypes) is the same at every sync, so what depends only on it is
worked out once (`PackPlan`, kept by the sender per layout): the offsets, the metadata records as
they go on the wire, the split of the buffer into each tensor's slice, and where each tensor's
fingerprint samples lie in the buffer. Packing is then one multi-tensor copy (`torch._foreach_copy_`,
a few kernels for the whole call instead of one per tensor) and the fingerprints one index gather
per dtype over the packed buffer (`PackPlan.fingerprint`)."""

from __future__ import annotations

from concurrent.futures import Future

import torch

from rollfleet.wire.buckets import Bucket, FlattenedTensorMetadata
from rollfleet.wire.fingerprint import Fingerprints, sample_positions
from rollfleet.wire.serialize import shared_cpu_buffer

ALIGN = 64  # bytes: every dtype view of a slice starts aligned


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def payload_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 buffer that a sender packs and serializes: on the CPU made in shared memory, since
    serializing a buffer outside it moves it there (a copy, a third of a CPU push under py-spy, and
    the old memory freed under any thread still reading it: the lora transport's directory writer)."""
    if torch.device(device).type == "cpu":
        return shared_cpu_buffer(nbytes)
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


class DoubleBuffer:
    def __init__(self, bucket_bytes: int):
        self.bucket_bytes = bucket_bytes
        self._buffers: list[torch.Tensor | None] = [None, None]

    def take(self, slot: int, nbytes: int, device: torch.device) -> torch.Tensor:
        """A 1-D uint8 tensor of at least `nbytes` on `device` from buffer `slot % 2` (a fresh one
        when the call is larger than a bucket: a decoder layer bigger than bucket_mb travels alone)."""
        if nbytes > self.bucket_bytes:
            return payload_buffer(nbytes, device)
        slot %= 2
        buffer, device = self._buffers[slot], torch.device(device)
        if device.type == "cuda" and device.index is None:  # "cuda" never equals a tensor's "cuda:0"
            device = torch.device("cuda", torch.cuda.current_device())
        if buffer is None or buffer.device != device or buffer.numel() < nbytes:
            # A whole bucket on a GPU: growing would leave the old buffer alive under an unfinished
            # transfer (three buffers). On the CPU, sized to the call and grown when needed.
            size = self.bucket_bytes if device.type == "cuda" else nbytes
            self._buffers[slot] = None
            buffer = self._buffers[slot] = payload_buffer(size, device)
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


def wire_dtype(tensor: torch.Tensor, cast_to: torch.dtype | None = None) -> torch.dtype:
    """The dtype `tensor` travels in: `cast_to` for a floating tensor (a sender that casts as it packs,
    `PackPlan`), else its own."""
    return cast_to if cast_to is not None and tensor.is_floating_point() else tensor.dtype


def call_bytes(call: list[tuple[str, torch.Tensor]], cast_to: torch.dtype | None = None) -> int:
    return sum(_aligned(t.numel() * wire_dtype(t, cast_to).itemsize) for _, t in call)


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
    (`payload["flattened_tensor"]`); a list of buckets there is a TypeError its scheduler does not catch.
    A sender that packs the same layout again keeps the `PackPlan` instead."""
    return PackPlan(call).pack(call, buffer)


def layout_of(call: list[tuple[str, torch.Tensor]], cast_to: torch.dtype | None = None) -> tuple:
    """What a call's packing depends on: each tensor's name, shape and dtype on the wire, in order."""
    return tuple((name, tensor.shape, wire_dtype(tensor, cast_to)) for name, tensor in call)


class PackPlan:
    """Where each tensor of one call layout lies in a packed bucket (SGLang's byte form, see
    `pack_call`), worked out once and reused by every sync that sends the same layout."""

    def __init__(self, call: list[tuple[str, torch.Tensor]], cast_to: torch.dtype | None = None):
        """`cast_to`: floating tensors go in this dtype, cast as they are packed (None: their own)."""
        self.cast_to, self.layout = cast_to, layout_of(call, cast_to)
        self.metadata: list[FlattenedTensorMetadata] = []
        self._sizes: list[int] = []  # the buffer's split: each tensor's bytes, then its padding
        offset = 0
        for name, tensor in call:
            dtype = wire_dtype(tensor, cast_to)
            nbytes = tensor.numel() * dtype.itemsize
            meta = FlattenedTensorMetadata(name, tuple(tensor.shape), dtype, offset, offset + nbytes, nbytes)
            self.metadata.append(meta)
            self._sizes += [nbytes, _aligned(nbytes) - nbytes]
            offset += _aligned(nbytes)
        self.nbytes = offset
        self._wire = [meta.to_wire() for meta in self.metadata]  # what the payload pickles, made once
        self._samples: dict[tuple[int, torch.device], list] = {}  # (samples, device) -> per dtype
        self._kept: tuple[tuple, list[torch.Tensor]] | None = None  # (buffer, its slices) of `keep_views`

    def pack(self, call: list[tuple[str, torch.Tensor]], buffer: torch.Tensor, *, keep_views: bool = False) -> Bucket:
        """Copy the call's tensors (of this plan's layout) into `buffer` (1-D uint8, at least
        `nbytes`), one multi-tensor copy; the bucket's payload carries the plan's metadata records.
        `keep_views` (a sender that packs into the same buffer every time, and no cast): the
        buffer's slices, in each tensor's dtype and shape, are kept for the next pack into it, so
        the tensors are copied as they are (a rank-32 LoRA adapter's 336 tensors: 1.5 -> 0.5 ms on
        this project's 2-core CPU); they hold that buffer until a pack into another one or without them."""
        assert layout_of(call, self.cast_to) == self.layout, "a PackPlan packs only the layout it was made for"
        flat = buffer[: self.nbytes]
        if keep_views:
            assert self.cast_to is None, "kept views copy the tensors as they are: no cast"
            with torch.no_grad():
                torch._foreach_copy_(self._views_in(flat), [tensor for _, tensor in call])
            return Bucket(flat, self.metadata, wire=self._wire)
        self._kept = None  # a sender that stopped reusing its buffer: let it go
        slices = flat.split(self._sizes)[::2]
        # tensors already in their wire dtype are copied as bytes; the others are cast by the copy
        # (torch._foreach_copy_ casts: one multi-tensor kernel per dtype pair, no cast copy of its own)
        copies: dict[tuple[torch.dtype, torch.dtype], tuple[list, list]] = {}
        with torch.no_grad():  # the views need no detach() each: a third of this loop's dispatches
            for (_, tensor), part, meta in zip(call, slices, self.metadata):
                tensor = tensor.reshape(-1)
                if tensor.dtype == meta.dtype:
                    pair, part, tensor = (torch.uint8, torch.uint8), part, tensor.view(torch.uint8)
                else:
                    pair, part = (meta.dtype, tensor.dtype), part.view(meta.dtype)
                into, sources = copies.setdefault(pair, ([], []))
                into.append(part)
                sources.append(tensor)
            for into, sources in copies.values():
                torch._foreach_copy_(into, sources)
        return Bucket(flat, self.metadata, wire=self._wire)

    @property
    def kept_buffer(self) -> int | None:
        """The address of the buffer whose slices this plan keeps (`keep_views`), or None."""
        return None if self._kept is None else self._kept[0][0]

    def _views_in(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each tensor's slice of `flat` in its dtype and shape; made once per buffer (the last one)."""
        key = (flat.data_ptr(), flat.device)
        if self._kept is None or self._kept[0] != key:
            parts = flat.split(self._sizes)[::2]
            self._kept = (key, [part.view(meta.dtype).view(meta.shape) for part, meta in zip(parts, self.metadata)])
        return self._kept[1]

    def fingerprint(self, bucket: Bucket, collector: Fingerprints) -> None:
        """Add every tensor's fingerprint samples, read from the packed bucket: one index gather per
        dtype (the same elements `sample_view` takes from each tensor, so the same fingerprints)."""
        flat = bucket.flattened_tensor
        for dtype, index, records in self._sample_index(collector.samples, flat.device):
            collector.add_gathered(records, flat.view(dtype)[index])

    def _sample_index(self, samples: int, device: torch.device) -> list:
        """Per dtype of the call: (dtype, positions of every sample in the buffer viewed as that
        dtype, (name, shape, count) per tensor), on `device`; computed once per device."""
        key = (samples, device)
        if key not in self._samples:
            by_dtype: dict[torch.dtype, tuple[list, list]] = {}
            for meta in self.metadata:
                numel = meta.numel // meta.dtype.itemsize
                positions = sample_positions(numel, samples) + meta.start_idx // meta.dtype.itemsize
                members = by_dtype.setdefault(meta.dtype, ([], []))
                members[0].append(positions)
                members[1].append((meta.name, meta.shape, positions.numel()))
            self._samples[key] = [
                (dtype, torch.cat(positions).to(device), records) for dtype, (positions, records) in by_dtype.items()
            ]
        return self._samples[key]


class PackPlans:
    """A sender's plans by call layout, kept across syncs (layouts only: no device memory beyond
    the sample positions)."""

    LIMIT = 256  # layouts kept; a sender whose layouts change every sync does not grow without bound

    def __init__(self):
        self._plans: dict[tuple, PackPlan] = {}

    def plan(self, call: list[tuple[str, torch.Tensor]], cast_to: torch.dtype | None = None) -> PackPlan:
        key = (layout_of(call, cast_to), cast_to)
        found = self._plans.get(key)
        if found is None:
            if len(self._plans) >= self.LIMIT:
                self._plans.clear()
            found = self._plans[key] = PackPlan(call, cast_to)
        return found


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
