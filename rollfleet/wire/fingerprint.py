"""Fingerprints that prove an engine holds exactly the tensors that were sent.

A fingerprint hashes a fixed sample of a tensor's elements, cast to the engine's dtype and then to
float32, plus the shape. The sample is every `step`-th element of the flattened tensor, `samples`
of them with `step = numel // samples` (all elements when there are fewer): a strided view, so
sampling launches no kernel per tensor. Casts between the dtypes used here are exact into float32,
so sender and engine agree bit for bit on the same weights, on any device.

`Fingerprints` batches many tensors: pending samples are gathered with one `torch.cat` per dtype and
copied to the host once, at `digests()` (or earlier, `hash_gathered`), and hashed on a thread of
their own, so that a sender's thread does not wait for the copy or the hashing. Pending views keep
their tensors alive, so the collector gathers early once they reference more than `hold_bytes` (a
sender's gathered full tensors are temporaries).

A sender that fingerprints what it packed (the LoRA transport: an adapter as sent) samples its
packed buffer instead, with ONE index gather per dtype (`sample_positions` of each tensor, offset
to where it lies, computed once per layout: rollfleet.weights.transports.staging.PackPlan).
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import Future, ThreadPoolExecutor

import torch

DEFAULT_SAMPLES = 4096
HOLD_BYTES = 256 << 20


def sample_view(tensor: torch.Tensor, samples: int = DEFAULT_SAMPLES) -> torch.Tensor:
    """The sampled elements of `tensor` as a 1-D view (a copy only for a non-contiguous tensor)."""
    flat = tensor.detach().reshape(-1)
    if flat.numel() <= samples:
        return flat
    step = flat.numel() // samples
    return flat[: step * samples : step]


def sample_positions(numel: int, samples: int = DEFAULT_SAMPLES) -> torch.Tensor:
    """Which elements of a flattened tensor of `numel` elements `sample_view` takes (int64, on the CPU)."""
    if numel <= samples:
        return torch.arange(numel)
    return torch.arange(samples) * (numel // samples)


def _digest(data, shape: tuple[int, ...]) -> str:
    """`data`: a float32 tensor on the host, or its bytes."""
    if isinstance(data, torch.Tensor):
        data = memoryview(data.contiguous().numpy()).cast("B")
    digest = hashlib.sha256(data)
    digest.update(str(tuple(shape)).encode())
    return digest.hexdigest()[:24]


def _as_float32(values: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    if dtype is not None and values.dtype != dtype:
        values = values.to(dtype)
    return values.to(torch.float32)


class Fingerprints:
    """Collect fingerprints of many tensors; one host copy per device at `digests()`."""

    def __init__(
        self, dtype: torch.dtype | None = None, samples: int = DEFAULT_SAMPLES, hold_bytes: float = HOLD_BYTES
    ):
        self.dtype, self.samples, self.hold_bytes = dtype, samples, hold_bytes
        self._views: list[tuple[str, tuple[int, ...], torch.Tensor]] = []
        self._held = 0
        self._gathered: list[tuple[list[tuple[str, tuple[int, ...], int]], torch.Tensor]] = []
        self._hashing: list[tuple[int, Future]] = []  # (tensors, their digests) on the hashing thread
        self._hashed: dict[str, str] = {}

    def add(self, name: str, tensor: torch.Tensor) -> None:
        self._views.append((name, tuple(tensor.shape), sample_view(tensor, self.samples)))
        self._held += tensor.numel() * tensor.element_size()
        if self._held > self.hold_bytes:
            self.flush()

    def add_sample(self, name: str, shape: tuple[int, ...], sample: torch.Tensor) -> None:
        """`sample`: `sample_view(tensor, self.samples)` of a tensor of `shape` that outlives the
        collector's next `flush()` (an engine's parameter)."""
        self._views.append((name, tuple(shape), sample))

    def add_gathered(self, records: list[tuple[str, tuple[int, ...], int]], values: torch.Tensor) -> None:
        """Samples gathered already: `values` holds each record's (name, shape, count) samples back to
        back, as `sample_view` takes them, in the tensors' own dtype."""
        self._gathered.append((list(records), _as_float32(values, self.dtype)))

    def flush(self) -> None:
        """Gather the pending views now, on their device (one `cat` per device and dtype): their
        tensors may change or go after this."""
        groups: dict[tuple[torch.device, torch.dtype], list] = {}
        for entry in self._views:
            groups.setdefault((entry[2].device, entry[2].dtype), []).append(entry)
        for entries in groups.values():
            values = _as_float32(torch.cat([view for _, _, view in entries]), self.dtype)
            self._gathered.append(([(name, shape, view.numel()) for name, shape, view in entries], values))
        self._views, self._held = [], 0

    @property
    def pending(self) -> int:
        """Tensors added since the last `digests()`."""
        queued = sum(len(records) for records, _ in self._gathered) + sum(n for n, _ in self._hashing)
        return len(self._views) + queued + len(self._hashed)

    def hash_gathered(self, *, wait: bool = True) -> None:
        """Hash what was gathered so far: its device-to-host copy is queued now, on the stream that
        made it, and a worker thread waits for it and hashes (a sender goes on packing and posting
        meanwhile). `wait=False` returns at once; `digests()` waits for every hash."""
        by_device: dict[torch.device, list] = {}
        for records, values in self._gathered:
            by_device.setdefault(values.device, []).append((records, values))
        for batches in by_device.values():
            values = batches[0][1] if len(batches) == 1 else torch.cat([values for _, values in batches])
            host, ready = values, None
            if values.is_cuda:  # the one device-to-host copy, into pinned memory, its end an event
                host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
                host.copy_(values, non_blocking=True)
                ready = torch.cuda.Event()
                ready.record(torch.cuda.current_stream(values.device))
            records = [record for records, _ in batches for record in records]
            self._hashing.append((len(records), _hasher().submit(_hash_samples, host, ready, records)))
        self._gathered = []
        if wait:
            for _, hashed in self._hashing:  # in order: the later of two for one name wins
                self._hashed.update(hashed.result())
            self._hashing = []

    def digests(self) -> dict[str, str]:
        """Every fingerprint collected since the last call; the later of two for one name wins."""
        self.flush()
        self.hash_gathered()
        out, self._hashed = self._hashed, {}
        return out


_HASHER: tuple[int, ThreadPoolExecutor] | None = None  # (the process it belongs to, its one thread)


def _hasher() -> ThreadPoolExecutor:
    """The process's hashing thread (a forked child makes its own: its parent's thread is not in it)."""
    global _HASHER
    if _HASHER is None or _HASHER[0] != os.getpid():
        _HASHER = (os.getpid(), ThreadPoolExecutor(1, thread_name_prefix="fingerprints"))
    return _HASHER[1]


def _hash_samples(host: torch.Tensor, ready, records: list[tuple[str, tuple[int, ...], int]]) -> dict[str, str]:
    """`records`' fingerprints from their float32 samples back to back in `host`, once `ready` (a CUDA
    event, or None) has passed (hashlib lets other threads run while it hashes)."""
    if ready is not None:
        ready.synchronize()
    data, start, out = memoryview(host.numpy()).cast("B"), 0, {}  # float32: 4 bytes per value
    for name, shape, count in records:
        out[name] = _digest(data[4 * start : 4 * (start + count)], shape)
        start += count
    return out


def fingerprints(named_tensors, dtype: torch.dtype | None = None, samples: int = DEFAULT_SAMPLES) -> dict[str, str]:
    collector = Fingerprints(dtype, samples)
    for name, tensor in named_tensors:
        collector.add(name, tensor)
    return collector.digests()


def mismatches(expected: dict[str, str], got: dict[str, str]) -> list[str]:
    """Names whose fingerprints differ or are missing on the engine side."""
    return sorted(name for name, value in expected.items() if got.get(name) != value)
