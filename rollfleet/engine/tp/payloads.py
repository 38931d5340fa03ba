"""Tensor payloads of `/update_weights_from_tensor` and `/load_lora_adapter_from_tensors`: one
entry per tp rank, each rank decodes its own (SGLang's rule).

load_format "rollfleet_resident" (the embedded engine's own, never sent to SGLang): an entry is
`{"mapping": id, "tensors": [(name, tensor), ...] | None}`. With tensors, the engine loads them and
keeps them under `id` (they are the sender's own parameters, mapped once); with None it loads again
from the tensors it keeps under `id` (rollfleet.weights.transports.resident says when a sender may).
A LoRA load's entry carries the sender's bucket instead of pairs (its reused buffer, mapped once:
rollfleet.weights.transports.lora)."""

from __future__ import annotations

import operator
from collections import Counter, OrderedDict
from typing import Any

import torch

from rollfleet.wire.buckets import Bucket
from rollfleet.wire.control_requests import RESIDENT_LOAD_FORMAT
from rollfleet.wire.serialize import LocalSerializedTensor, safe_loads

MAX_MAPPING_CHARS = 64


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


def named_tensors(
    payload: Any, load_format: str | None, rank: int, views: BucketViews | None = None
) -> dict[str, torch.Tensor]:
    """Rank `rank`'s decoded payload -> checkpoint name -> full tensor.

    null / "direct": a list of (name, tensor) pairs, or one dict {name: tensor} (SGLang's LoRA
    payload); a tensor may be wrapped in SGLang's LocalSerializedTensor (verl), of which this rank
    reads its own value. "flattened_bucket": one bucket payload `{"flattened_tensor", "metadata"}`
    or a list of them (`views`: an engine's `BucketViews`, which unpacks a layout seen before in the
    same buffer without reading its records again).
    """
    if load_format == "flattened_bucket":
        payloads = payload if isinstance(payload, (list, tuple)) else [payload]
        unpack = views.unpack if views is not None else _unpacked
        try:
            pairs = [pair for item in payloads for pair in unpack(item).items()]
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


def resident_payload(payload: Any, rank: int) -> tuple[str, dict[str, torch.Tensor] | None]:
    """A decoded "rollfleet_resident" entry -> (mapping id, its tensors or None: load the kept ones)."""
    mapping, pairs = resident_entry(payload)
    return mapping, None if pairs is None else named_tensors(pairs, None, rank)


def resident_entry(payload: Any) -> tuple[str, Any]:
    """A decoded "rollfleet_resident" entry, checked -> (mapping id, what it carries or None). A LoRA
    load's carries a bucket (`{"flattened_tensor", "metadata"}`), a weight update's (name, tensor) pairs."""
    if type(payload) is not dict or set(payload) != {"mapping", "tensors"}:
        keys = sorted(map(str, payload)) if isinstance(payload, dict) else type(payload).__name__
        raise PayloadError(
            f"load_format={RESIDENT_LOAD_FORMAT!r} expects each entry to be "
            f"{{'mapping': id, 'tensors': pairs or None}}, got {keys}"
        )
    mapping, pairs = payload["mapping"], payload["tensors"]
    if type(mapping) is not str or not 0 < len(mapping) <= MAX_MAPPING_CHARS:
        raise PayloadError(
            f"load_format={RESIDENT_LOAD_FORMAT!r}: mapping={str(mapping)[:80]!r} must be a string of 1 to "
            f"{MAX_MAPPING_CHARS} characters"
        )
    return mapping, pairs


def _unpacked(payload: Any) -> dict[str, torch.Tensor]:
    return Bucket.from_payload(payload).unpack()


_RECORD_FIELDS = operator.attrgetter("name", "shape", "dtype", "start_idx", "end_idx", "numel")


class BucketViews:
    """The tensors of the buckets an engine unpacked lately, by the buffer they lie in and their
    records' values: a sender packs every push into the same two buffers with the same layouts, and
    an engine that holds those buffers (`WeightUpdater`'s held payloads) gets the same storage back
    for their handles, so call k+2 of a push needs no records read, checked and viewed again (6-8 us
    a tensor on this project's CPU, 44 tensors a call of the benches' model).

    The key is the flat tensor's address, size, dtype and device, and each record's six fields,
    taken only when they have exactly the types a checked record has (a str name, a torch.Size shape,
    a torch.dtype, int indices): anything else, a dict record included, is read the slow way
    (`Bucket.from_payload`), so every refusal stays what it was. The views hold their buffer's
    storage, so an address in the key cannot be reused by another allocation while it is cached:
    at most `limit` buffers are kept (the payloads their owner holds anyway: a tensor sender's two, a
    LoRA sender's one), none after a payload read the slow way, and `clear()` drops them with the
    payloads."""

    def __init__(self, limit: int = 2):
        self.limit = limit
        self._views: OrderedDict[tuple, dict[str, torch.Tensor]] = OrderedDict()

    def clear(self) -> None:
        self._views.clear()

    def __len__(self) -> int:
        return len(self._views)

    def unpack(self, payload: Any) -> dict[str, torch.Tensor]:
        key = _views_key(payload)
        if key is None:
            self.clear()  # the buffers kept are no longer the latest
            return _unpacked(payload)
        found = self._views.get(key)
        if found is None:
            found = _unpacked(payload)  # raises on a bad record: nothing is kept
            self._views[key] = found
            while len(self._views) > self.limit:
                self._views.popitem(last=False)
        else:
            self._views.move_to_end(key)
        return dict(found)


def _views_key(payload: Any) -> tuple | None:
    """What a bucket's unpacking depends on, or None when the payload is not in the exact form
    `BucketViews` keeps (see there)."""
    if type(payload) is not dict or len(payload) != 2:
        return None
    flat, records = payload.get("flattened_tensor"), payload.get("metadata")
    if type(flat) is not torch.Tensor or flat.dim() != 1 or type(records) is not list:
        return None
    try:
        fields = tuple(map(_RECORD_FIELDS, records))
    except AttributeError:  # a dict record, or one lacking a field: read the slow way
        return None
    for name, shape, dtype, start, end, numel in fields:
        if not (
            type(name) is str
            and type(shape) is torch.Size
            and type(dtype) is torch.dtype
            and type(start) is int
            and type(end) is int
            and type(numel) is int
        ):
            return None
    return flat.data_ptr(), flat.numel(), flat.dtype, flat.device, fields


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
