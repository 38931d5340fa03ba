"""Tensor payloads of `/update_weights_from_tensor` and `/load_lora_adapter_from_tensors`: one
entry per tp rank, each rank decodes its own (SGLang's rule)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

from rollfleet.wire.buckets import Bucket
from rollfleet.wire.serialize import LocalSerializedTensor, safe_loads


class PayloadError(ValueError):
    """A payload that cannot be read; nothing was applied."""


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def decode_entry(entries: list[str], rank: int) -> Any:
    """Rank `rank`'s entry, unpickled through the allowlist."""
    try:
        return safe_loads(entries[rank])
    except Exception as exc:  # untrusted bytes: every failure to rebuild them is the sender's, reported
        raise PayloadError(
            f"serialized_named_tensors[{rank}] cannot be read: {type(exc).__name__}: {first_line(exc)}"
        ) from exc


def named_tensors(payload: Any, load_format: str | None, rank: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s decoded payload -> checkpoint name -> full tensor.

    null / "direct": a list of (name, tensor) pairs, or one dict {name: tensor} (SGLang's LoRA
    payload); a tensor may be wrapped in SGLang's LocalSerializedTensor (verl), of which this rank
    reads its own value. "flattened_bucket": one bucket payload `{"flattened_tensor", "metadata"}`
    or a list of them.
    """
    if load_format == "flattened_bucket":
        payloads = payload if isinstance(payload, (list, tuple)) else [payload]
        try:
            pairs = [pair for item in payloads for pair in Bucket.from_payload(item).unpack().items()]
        except ValueError as exc:
            raise PayloadError(str(exc)) from exc
    else:
        pairs = [(name, unwrapped(name, value, rank)) for name, value in _pairs_of(payload, load_format)]
    not_tensors = sorted(name for name, tensor in pairs if not isinstance(tensor, torch.Tensor))
    if not_tensors:
        raise PayloadError(f"not tensors: {', '.join(not_tensors[:10])}")
    tensors = dict(pairs)
    if len(tensors) != len(pairs):
        twice = sorted(name for name, count in Counter(name for name, _ in pairs).items() if count > 1)
        raise PayloadError(f"names sent twice: {', '.join(twice[:10])}")
    return tensors


def _pairs_of(payload: Any, load_format: str | None) -> list[tuple[str, Any]]:
    if isinstance(payload, dict) and all(isinstance(name, str) for name in payload):
        return list(payload.items())
    if isinstance(payload, (list, tuple)) and all(
        isinstance(p, (list, tuple)) and len(p) == 2 and isinstance(p[0], str) for p in payload
    ):
        return list(payload)
    raise PayloadError(
        f"load_format={load_format!r} expects a list of (name, tensor) pairs or a dict {{name: tensor}}, got "
        f"{type(payload).__name__}; bucket payloads need load_format='flattened_bucket'"
    )


def unwrapped(name: str, value: Any, rank: int) -> Any:
    """A tensor as sent, or this rank's value of a LocalSerializedTensor (read through the allowlist)."""
    if not isinstance(value, LocalSerializedTensor):
        return value
    try:
        return value.get(rank)
    except Exception as exc:  # untrusted bytes, as in decode_entry
        raise PayloadError(f"{name}: {type(exc).__name__}: {first_line(exc)}") from exc
