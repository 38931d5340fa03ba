"""Fingerprints that prove an engine holds exactly the tensors that were sent.

A fingerprint hashes a fixed sample of a tensor's elements (evenly spaced, `samples` of them, or
all when fewer) after casting to the engine's dtype, as float32 bytes: casts between the dtypes
used here are exact into float32, so sender and engine agree bit for bit on the same weights.
"""

from __future__ import annotations

import hashlib

import torch

DEFAULT_SAMPLES = 4096


def fingerprint(tensor: torch.Tensor, dtype: torch.dtype | None = None, samples: int = DEFAULT_SAMPLES) -> str:
    flat = tensor.detach().reshape(-1)
    if dtype is not None and flat.dtype != dtype:
        flat = flat.to(dtype)
    if flat.numel() > samples:
        index = torch.linspace(0, flat.numel() - 1, samples, device=flat.device).round().long()
        flat = flat[index]
    data = flat.to(device="cpu", dtype=torch.float32, copy=True).contiguous()
    digest = hashlib.sha256(data.view(torch.uint8).numpy().tobytes())
    digest.update(str(tuple(tensor.shape)).encode())
    return digest.hexdigest()[:24]


def mismatches(expected: dict[str, str], got: dict[str, str]) -> list[str]:
    """Names whose fingerprints differ or are missing on the engine side."""
    return sorted(name for name, value in expected.items() if got.get(name) != value)
