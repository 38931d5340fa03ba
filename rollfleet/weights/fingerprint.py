"""Fingerprints that prove an engine holds exactly the tensors that were sent.

A fingerprint hashes a fixed sample of a tensor's elements, cast to the engine's dtype and then to
float32, plus the shape. The sample is every `step`-th element of the flattened tensor, `samples`
of them with `step = numel // samples` (all elements when there are fewer): a strided view, so
sampling launches no kernel per tensor. Casts between the dtypes used here are exact into float32,
so sender and engine agree bit for bit on the same weights, on any device.

`Fingerprints` batches many tensors: pending samples are gathered with one `torch.cat` per dtype,
copied to the host without blocking and hashed once the copy is done, so hashing overlaps the
transfer instead of following it. Pending views keep their tensors alive, so the collector
gathers early once they reference more than `hold_bytes` (a sender's gathered full tensors are
temporaries).
"""

from __future__ import annotations

import hashlib

import torch

DEFAULT_SAMPLES = 4096
HOLD_BYTES = 256 << 20


def sample_view(tensor: torch.Tensor, samples: int = DEFAULT_SAMPLES) -> torch.Tensor:
    """The sampled elements of `tensor` as a 1-D view (a copy only for a non-contiguous tensor)."""
    flat = tensor.detach().reshape(-1)
    if flat.numel() <= samples:
        return flat
    step = flat.numel() // samples
    return flat[: step * samples: step]


def _digest(values: torch.Tensor, shape: tuple[int, ...]) -> str:
    digest = hashlib.sha256(values.contiguous().view(torch.uint8).numpy().tobytes())
    digest.update(str(tuple(shape)).encode())
    return digest.hexdigest()[:24]


def _as_float32(values: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    if dtype is not None and values.dtype != dtype:
        values = values.to(dtype)
    return values.to(torch.float32)


def fingerprint(tensor: torch.Tensor, dtype: torch.dtype | None = None, samples: int = DEFAULT_SAMPLES) -> str:
    return _digest(_as_float32(sample_view(tensor, samples), dtype).cpu(), tuple(tensor.shape))


class Fingerprints:
    """Collect fingerprints of many tensors, hashing them while the device works on.

    Pending sample views are gathered (one `cat` per device and dtype) once they reference more
    than `hold_bytes`, or at `flush()`; a gathered GPU batch goes to pinned host memory without
    blocking, and is hashed by a later `add`/`flush` once its copy has finished, or by
    `digests()`, which waits for the rest."""

    def __init__(self, dtype: torch.dtype | None = None, samples: int = DEFAULT_SAMPLES,
                 hold_bytes: float = HOLD_BYTES):
        self.dtype, self.samples, self.hold_bytes = dtype, samples, hold_bytes
        self._views: list[tuple[str, tuple[int, ...], torch.Tensor]] = []
        self._held = 0
        self._batches: list[tuple[list[tuple[str, tuple[int, ...], int]], torch.Tensor, object]] = []
        self._digests: dict[str, str] = {}

    def add(self, name: str, tensor: torch.Tensor) -> None:
        self._views.append((name, tuple(tensor.shape), sample_view(tensor, self.samples)))
        self._held += tensor.numel() * tensor.element_size()
        if self._held > self.hold_bytes:
            self.flush()

    def flush(self) -> None:
        """Gather the pending views now (their tensors may change or go after this), and hash the
        batches whose host copy has finished."""
        groups: dict[tuple[torch.device, torch.dtype], list] = {}
        for entry in self._views:
            groups.setdefault((entry[2].device, entry[2].dtype), []).append(entry)
        for entries in groups.values():
            values = _as_float32(torch.cat([view for _, _, view in entries]), self.dtype)
            records = [(name, shape, view.numel()) for name, shape, view in entries]
            copied = None
            if values.is_cuda:  # to the host without waiting for the device
                host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
                host.copy_(values, non_blocking=True)
                copied = torch.cuda.Event()
                copied.record()
                values = host
            self._batches.append((records, values, copied))
        self._views, self._held = [], 0
        self._hash(wait=False)

    def _hash(self, wait: bool) -> None:
        while self._batches:
            records, values, copied = self._batches[0]
            if copied is not None:
                if not wait and not copied.query():
                    return  # batches finish in order: the later ones are not ready either
                copied.synchronize()
            start = 0
            for name, shape, count in records:
                self._digests[name] = _digest(values[start:start + count], shape)
                start += count
            self._batches.pop(0)

    def digests(self) -> dict[str, str]:
        """Every fingerprint collected since the last call (waits for the device's copies)."""
        self.flush()
        self._hash(wait=True)
        out, self._digests = self._digests, {}
        return out


def fingerprints(named_tensors, dtype: torch.dtype | None = None, samples: int = DEFAULT_SAMPLES) -> dict[str, str]:
    collector = Fingerprints(dtype, samples)
    for name, tensor in named_tensors:
        collector.add(name, tensor)
    return collector.digests()


def mismatches(expected: dict[str, str], got: dict[str, str]) -> list[str]:
    """Names whose fingerprints differ or are missing on the engine side."""
    return sorted(name for name, value in expected.items() if got.get(name) != value)
