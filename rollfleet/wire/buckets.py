"""Named full tensors -> flattened buckets of one dtype each, and back (SGLang's "flattened_bucket").

A bucket is one 1-D tensor holding several tensors back to back, plus one metadata record per
tensor with SGLang's field names (python/sglang/srt/weight_sync/tensor_bucket.py):
`name, shape, dtype, start_idx, end_idx, numel`. The payload of a "flattened_bucket" weight update
is `{"flattened_tensor": <1-D tensor>, "metadata": [record, ...]}`.

rollfleet's buckets hold ONE dtype each and index in elements of that dtype. That form is read the
same way by both SGLang generations: the older one slices elements (`flat[start:end]`), the newer
one (`supports_multi_dtypes`) slices bytes of a uint8 tensor and then `.view(dtype)`, which on a
single-dtype bucket is a no-op on elements. Received buckets in the newer uint8 form are accepted
too (`Bucket.unpack`).

On the wire each record is a `types.SimpleNamespace` (SGLang reads records by attribute, and
its unpickling allowlist admits `types.*`), with `shape` a `torch.Size` and `dtype` a `torch.dtype`.
"""

from __future__ import annotations

import math
import operator
import types
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

# The dtype names SGLang's HTTP requests carry (`getattr(torch, name)` on its side).
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "bool": torch.bool,
}
DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}


def dtype_from_name(name: str | torch.dtype) -> torch.dtype:
    """'bfloat16' -> torch.bfloat16 (a torch.dtype passes through); ValueError lists the known names."""
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[name]
    except (KeyError, TypeError):
        raise ValueError(f"dtype {name!r} is not known: use one of {sorted(DTYPES)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> 'bfloat16' (the form SGLang's `dtypes` fields use)."""
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} has no wire name: use one of {sorted(DTYPES)}") from None


@dataclass(frozen=True)
class FlattenedTensorMetadata:
    """Where one tensor lives in a bucket: `flattened_tensor[start_idx:end_idx]`, reshaped to `shape`."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int

    def to_wire(self) -> types.SimpleNamespace:
        return types.SimpleNamespace(**{**asdict(self), "shape": torch.Size(self.shape)})

    @classmethod
    def from_wire(cls, record: Any) -> FlattenedTensorMetadata:
        """A record as SGLang senders pickle it (attributes) or as a dict with the same keys."""

        def field(key: str):
            value = record.get(key) if isinstance(record, dict) else getattr(record, key, None)
            if value is None:
                raise ValueError(f"bucket metadata record {record!r} has no {key!r}")
            return value

        try:  # operator.index: whole numbers only (int(0.5) would read element 0 of a sender's mistake)
            meta = cls(
                name=str(field("name")),
                shape=tuple(operator.index(d) for d in field("shape")),
                dtype=dtype_from_name(field("dtype")),
                start_idx=operator.index(field("start_idx")),
                end_idx=operator.index(field("end_idx")),
                numel=operator.index(field("numel")),
            )
        except TypeError as exc:
            raise ValueError(f"bucket metadata record {record!r} is malformed: {exc}") from exc
        if any(d < 0 for d in meta.shape):  # (-2, -2) has 4 elements, and no tensor has that shape
            raise ValueError(f"bucket metadata record of {meta.name}: shape {meta.shape} has a negative size")
        return meta


@dataclass
class Bucket:
    flattened_tensor: torch.Tensor
    metadata: list[FlattenedTensorMetadata]
    wire: list[types.SimpleNamespace] | None = field(default=None, repr=False)  # `metadata` on the wire, if made

    @property
    def dtype(self) -> torch.dtype:
        return self.flattened_tensor.dtype

    @property
    def nbytes(self) -> int:
        return self.flattened_tensor.numel() * self.flattened_tensor.element_size()

    @property
    def names(self) -> list[str]:
        return [m.name for m in self.metadata]

    @classmethod
    def pack(cls, named_tensors: list[tuple[str, torch.Tensor]], out: torch.Tensor | None = None) -> Bucket:
        """Flatten tensors of one dtype (and device) into one bucket, in the given order; into `out`
        (a 1-D tensor of that dtype and exactly their total size) when given."""
        if not named_tensors:
            raise ValueError("a bucket needs at least one tensor")
        dtypes = {t.dtype for _, t in named_tensors}
        if len(dtypes) != 1:
            raise ValueError(f"a bucket holds one dtype, got {sorted(map(str, dtypes))}")
        metadata, start = [], 0
        for name, tensor in named_tensors:
            numel = tensor.numel()
            metadata.append(
                FlattenedTensorMetadata(name, tuple(tensor.shape), tensor.dtype, start, start + numel, numel)
            )
            start += numel
        pieces = [t.detach().to(out.device if out is not None else t.device).reshape(-1) for _, t in named_tensors]
        flat = torch.cat(pieces) if out is None else torch.cat(pieces, out=out)
        return cls(flat, metadata)

    def unpack(self) -> dict[str, torch.Tensor]:
        """name -> tensor of the recorded shape and dtype (views into the flat tensor where possible).

        A flat tensor of the records' dtype is indexed in elements; a uint8 flat tensor holding
        other dtypes (newer SGLang senders) is indexed in bytes.
        """
        flat, out = self.flattened_tensor, {}
        if flat.dim() != 1:
            raise ValueError(f"flattened_tensor must be 1-D, got shape {tuple(flat.shape)}")
        typed: dict[torch.dtype, torch.Tensor | None] = {}  # the bytes viewed as each dtype (uint8 flat)
        for meta in self.metadata:
            by_bytes = flat.dtype == torch.uint8 and meta.dtype != torch.uint8
            if not by_bytes and flat.dtype != meta.dtype:
                raise ValueError(
                    f"{meta.name}: recorded dtype {meta.dtype} in a {flat.dtype} bucket; "
                    "a bucket holds one dtype (or is uint8 bytes)"
                )
            unit = meta.dtype.itemsize if by_bytes else 1
            expected = math.prod(meta.shape) * unit
            if (
                meta.numel != meta.end_idx - meta.start_idx
                or meta.numel != expected
                or not 0 <= meta.start_idx <= meta.end_idx <= flat.numel()
            ):
                raise ValueError(
                    f"{meta.name}: start_idx={meta.start_idx}, end_idx={meta.end_idx}, "
                    f"numel={meta.numel} do not fit shape {meta.shape} ({expected} "
                    f"{'bytes' if by_bytes else 'elements'}) in a bucket of {flat.numel()}"
                )
            if meta.name in out:
                raise ValueError(f"{meta.name} appears twice in one bucket")
            aligned = by_bytes and meta.start_idx % unit == 0
            if aligned and meta.dtype not in typed:
                typed[meta.dtype] = _typed_view(flat, meta.dtype)
            base = typed.get(meta.dtype) if aligned else None
            if base is not None:
                # one strided view of the bytes viewed as the dtype (a slice, a reinterpretation and a
                # reshape per tensor cost three times as much: an engine unpacks every tensor of a push)
                offset = base.storage_offset() + meta.start_idx // unit
                out[meta.name] = base.as_strided(meta.shape, _contiguous_strides(meta.shape), offset)
                continue
            piece = flat[meta.start_idx : meta.end_idx]
            if by_bytes:
                piece = view_bytes_as(piece, meta.dtype)
            out[meta.name] = piece.view(meta.shape)
        return out

    def to_payload(self) -> dict[str, Any]:
        """SGLang's "flattened_bucket" payload (pickle it with rollfleet.wire.serialize)."""
        wire = self.wire if self.wire is not None else [m.to_wire() for m in self.metadata]
        return {"flattened_tensor": self.flattened_tensor, "metadata": wire}

    @classmethod
    def from_payload(cls, payload: Any) -> Bucket:
        if not isinstance(payload, dict) or not {"flattened_tensor", "metadata"} <= payload.keys():
            raise ValueError(
                "a flattened_bucket payload is a dict with 'flattened_tensor' and 'metadata', "
                f"got {type(payload).__name__}"
            )
        flat, records = payload["flattened_tensor"], payload["metadata"]
        if not isinstance(flat, torch.Tensor) or not isinstance(records, (list, tuple)):
            raise ValueError("flattened_bucket: 'flattened_tensor' must be a tensor and 'metadata' a list")
        return cls(flat, [FlattenedTensorMetadata.from_wire(r) for r in records])


def _typed_view(flat: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """uint8 `flat`'s whole elements viewed as `dtype`, or None where its start is not aligned for it."""
    if flat.storage_offset() % dtype.itemsize or not flat.is_contiguous():
        return None
    return flat[: flat.numel() - flat.numel() % dtype.itemsize].view(dtype)


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def view_bytes_as(data: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reinterpret 1-D uint8 bytes as `dtype`; copies first when the bytes are not aligned for it."""
    if data.numel() % dtype.itemsize:
        raise ValueError(f"{data.numel()} bytes are not a whole number of {dtype} elements")
    if data.storage_offset() % dtype.itemsize:
        data = data.clone()
    return data.view(dtype)


def iter_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[Bucket]:
    """Stream tensors into buckets of one dtype and at most `bucket_bytes` each.

    At most one bucket per (dtype, device) is open at a time, holding references to its tensors;
    it is flattened (one copy) when the next tensor would overflow it, and at the end. A tensor
    larger than `bucket_bytes` gets a bucket of its own, alone. So the extra memory a sender holds
    is about one open bucket per dtype plus the one being flattened. Order within a bucket follows
    the input; buckets come out as they fill, then the still-open ones in the order they opened.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes={bucket_bytes}: must be positive")
    open_buckets: dict[tuple[torch.dtype, torch.device], tuple[list[tuple[str, torch.Tensor]], int]] = {}
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes > bucket_bytes:
            yield Bucket.pack([(name, tensor)])
            continue
        key = (tensor.dtype, tensor.device)
        members, used = open_buckets.get(key, ([], 0))
        if members and used + nbytes > bucket_bytes:
            yield Bucket.pack(members)
            members, used = [], 0
        members.append((name, tensor))
        open_buckets[key] = (members, used + nbytes)
    for members, _ in open_buckets.values():
        yield Bucket.pack(members)
