"""Fingerprints that prove an engine holds exactly the tensors that were sent.

A fingerprint hashes a fixed sample of a tensor's elements (`samples` of them at integer
positions `i * (numel - 1) // (samples - 1)`, or all when fewer) after casting to the engine's
dtype, as float32 bytes, plus the shape. Casts between the dtypes used here are exact into
float32 and the positions are integer arithmetic, so sender and engine agree bit for bit on the
same weights, on any device.

`Fingerprints` batches many tensors: the samples are gathered on the tensors' device and copied
to the host once, at `digests()`, so fingerprinting a sync costs one device-to-host copy, not
one per tensor.
"""

from __future__ import annotations

import hashlib

import torch

DEFAULT_SAMPLES = 4096
_positions: dict[tuple[int, int, torch.device], torch.Tensor] = {}


def sample_positions(numel: int, samples: int, device: torch.device) -> torch.Tensor:
    """The sampled element positions of a tensor of `numel` elements (cached per size and device)."""
    key = (numel, samples, device)
    index = _positions.get(key)
    if index is None:
        index = torch.arange(samples, dtype=torch.int64) * (numel - 1) // max(samples - 1, 1)
        index = _positions[key] = index.to(device)
        if len(_positions) > 4096:  # many distinct sizes: drop the oldest half
            for old in list(_positions)[:2048]:
                del _positions[old]
    return index


def sampled(tensor: torch.Tensor, dtype: torch.dtype | None = None, samples: int = DEFAULT_SAMPLES) -> torch.Tensor:
    """The sampled values, cast to `dtype` and then to float32, on the tensor's device."""
    flat = tensor.detach().reshape(-1)
    if flat.numel() > samples:
        flat = flat[sample_positions(flat.numel(), samples, flat.device)]
    if dtype is not None and flat.dtype != dtype:
        flat = flat.to(dtype)
    return flat.to(torch.float32)


def _digest(values: torch.Tensor, shape: tuple[int, ...]) -> str:
    digest = hashlib.sha256(values.contiguous().view(torch.uint8).numpy().tobytes())
    digest.update(str(tuple(shape)).encode())
    return digest.hexdigest()[:24]


def fingerprint(tensor: torch.Tensor, dtype: torch.dtype | None = None, samples: int = DEFAULT_SAMPLES) -> str:
    return _digest(sampled(tensor, dtype, samples).cpu(), tuple(tensor.shape))


class Fingerprints:
    """Collect fingerprints of many tensors; one host copy per device at `digests()`."""

    def __init__(self, dtype: torch.dtype | None = None, samples: int = DEFAULT_SAMPLES):
        self.dtype, self.samples = dtype, samples
        self._pending: dict[torch.device, list[tuple[str, tuple[int, ...], torch.Tensor]]] = {}

    def add(self, name: str, tensor: torch.Tensor) -> None:
        values = sampled(tensor, self.dtype, self.samples)
        self._pending.setdefault(values.device, []).append((name, tuple(tensor.shape), values))

    def digests(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for entries in self._pending.values():
            host = torch.cat([values for _, _, values in entries]).cpu()
            start = 0
            for name, shape, values in entries:
                out[name] = _digest(host[start:start + values.numel()], shape)
                start += values.numel()
        self._pending.clear()
        return out


def fingerprints(named_tensors, dtype: torch.dtype | None = None, samples: int = DEFAULT_SAMPLES) -> dict[str, str]:
    collector = Fingerprints(dtype, samples)
    for name, tensor in named_tensors:
        collector.add(name, tensor)
    return collector.digests()


def mismatches(expected: dict[str, str], got: dict[str, str]) -> list[str]:
    """Names whose fingerprints differ or are missing on the engine side."""
    return sorted(name for name, value in expected.items() if got.get(name) != value)
