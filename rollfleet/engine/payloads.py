"""Tensor payloads of `/update_weights_from_tensor` and `/load_lora_adapter_from_tensors`: one
entry per tp rank, each rank decodes its own (SGLang's rule)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

from rollfleet.wire.buckets import Bucket
from rollfleet.wire.serialize import safe_loads


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


def named_tensors(payload: Any, load_format: str | None) -> dict[str, torch.Tensor]:
    """One rank's decoded payload -> checkpoint name -> full tensor.

    null / "direct": a list of (name, tensor) pairs. "flattened_bucket": one bucket payload
    `{"flattened_tensor", "metadata"}` or a list of them.
    """
    if load_format == "flattened_bucket":
        payloads = payload if isinstance(payload, (list, tuple)) else [payload]
        try:
            pairs = [pair for item in payloads for pair in Bucket.from_payload(item).unpack().items()]
        except ValueError as exc:
            raise PayloadError(str(exc)) from exc
    else:
        if not isinstance(payload, (list, tuple)) or not all(
            isinstance(p, (list, tuple)) and len(p) == 2 and isinstance(p[0], str) for p in payload
        ):
            raise PayloadError(
                f"load_format={load_format!r} expects a list of (name, tensor) pairs, got "
                f"{type(payload).__name__}; bucket payloads need load_format='flattened_bucket'"
            )
        pairs = list(payload)
    not_tensors = sorted(name for name, tensor in pairs if not isinstance(tensor, torch.Tensor))
    if not_tensors:
        raise PayloadError(f"not tensors: {', '.join(not_tensors[:10])}")
    tensors = dict(pairs)
    if len(tensors) != len(pairs):
        twice = sorted(name for name, count in Counter(name for name, _ in pairs).items() if count > 1)
        raise PayloadError(f"names sent twice: {', '.join(twice[:10])}")
    return tensors
