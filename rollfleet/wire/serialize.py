"""Tensor payloads as base64 text for `/update_weights_from_tensor` (SGLang's wire form), and a
safe way to read them back.

`serialize` pickles with `ForkingPickler` (what SGLang's `MultiprocessingSerializer` uses), so
tensors travel as handles, not bytes: a CUDA tensor as a CUDA IPC handle, a CPU tensor as the
name of a shared-memory file. CPU sharing uses the "file_system" strategy on both sides: the
default "file_descriptor" strategy only works between a parent and the processes it spawned.
The sender must keep its tensors alive until the receiver has answered, and must serialize once
per receiving process (one entry per tp rank): a shared-memory file is reference counted, and
one serialization read by two ranks drops the count once too often, so the file disappears
while the sender still holds it and the next payload naming that storage cannot be opened
(seen on CPU; CUDA IPC counts references the same way).

`safe_loads` unpickles through an allowlist: only the torch functions that rebuild shared
tensors, the classes and dtypes they need, and `types.SimpleNamespace` (bucket metadata records)
may be named by the payload, and only metadata records may receive state (BUILD); anything else
raises `pickle.UnpicklingError` naming what was refused. Unpickling an arbitrary payload would be
remote code execution (CVE-2025-10164 in SGLang).
Named is not called: the payload may call only the rebuild functions, `torch.Size` and the record
class. The tensor and storage classes are arguments of the rebuild functions, never callable
themselves (`torch.UntypedStorage(n)` and `torch.Tensor(n)` allocate uninitialised memory). The
rebuild functions are called through checks: a tensor must lie inside the storage the payload
carried (`set_` would otherwise grow an empty storage over uninitialised heap memory). A payload
nested deeper than MAX_NESTING (or cyclic) is refused before anything reads it.
A payload can still name any shared-memory file or CUDA IPC handle of the same user: guard the
routes that accept payloads with an API key when the port is reachable by others.
"""

from __future__ import annotations

import base64
import binascii
import io
import pickle
import types
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing
from torch.multiprocessing import reductions  # importing it registers torch's reductions with ForkingPickler

SHARING_STRATEGY = "file_system"
MAX_NESTING = 32  # real payloads nest 5 deep: list -> bucket dict -> metadata list -> record -> shape
_STORAGE_CLASSES = (torch.UntypedStorage, torch.TypedStorage)
_TENSOR_CLASSES = (torch.Tensor, torch.nn.Parameter)


def _refuse(what: str) -> pickle.UnpicklingError:
    return pickle.UnpicklingError(f"refused payload: {what}")


def _check_class(value: Any, allowed: tuple[type, ...], what: str) -> None:
    if value not in allowed:
        raise _refuse(f"{what} {value!r} is not one of {[c.__name__ for c in allowed]}")


def _check_extent(storage_bytes: int, itemsize: int, offset: Any, size: Any, stride: Any, what: str) -> None:
    """The elements a tensor of (offset, size, stride) reads must lie inside `storage_bytes`."""
    dims = (offset, *size, *stride)
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in dims) or len(size) != len(stride):
        raise _refuse(f"{what}: offset {offset!r}, size {size!r}, stride {stride!r} are not a tensor layout")
    last = offset + sum((n - 1) * step for n, step in zip(size, stride)) if all(size) else offset - 1
    if (last + 1) * itemsize > storage_bytes:
        raise _refuse(
            f"{what}: a tensor of size {tuple(size)}, stride {tuple(stride)}, offset {offset} needs "
            f"{(last + 1) * itemsize} bytes, its storage holds {storage_bytes}"
        )


def _rebuild_tensor(cls, storage, metadata):
    _check_class(cls, _TENSOR_CLASSES, "rebuild_tensor: class")
    if not isinstance(storage, torch.TypedStorage):  # what torch pickles: rebuild_typed_storage(untyped, dtype)
        raise _refuse(f"rebuild_tensor: storage is a {type(storage).__name__}, not a typed storage")
    if not (isinstance(metadata, tuple) and len(metadata) == 4 and isinstance(metadata[3], bool)):
        raise _refuse("rebuild_tensor: metadata is not (offset, size, stride, requires_grad)")
    offset, size, stride, _ = metadata
    if not isinstance(size, tuple) or not isinstance(stride, tuple):
        raise _refuse("rebuild_tensor: size and stride must be tuples")
    _check_extent(storage._untyped_storage.nbytes(), storage.dtype.itemsize, offset, size, stride, "rebuild_tensor")
    return reductions.rebuild_tensor(cls, storage, metadata)


def _rebuild_cuda_tensor(tensor_cls, tensor_size, tensor_stride, tensor_offset, storage_cls, dtype, *rest):
    _check_class(tensor_cls, _TENSOR_CLASSES, "rebuild_cuda_tensor: class")
    _check_class(storage_cls, _STORAGE_CLASSES, "rebuild_cuda_tensor: storage class")
    if not isinstance(dtype, torch.dtype) or len(rest) != 9 or not isinstance(rest[2], int):
        raise _refuse("rebuild_cuda_tensor: arguments are not those torch pickles for a CUDA tensor")
    storage_bytes = rest[2] if rest[1] is not None else 0  # storage_size_bytes; no handle = empty storage
    _check_extent(storage_bytes, dtype.itemsize, tensor_offset, tuple(tensor_size), tuple(tensor_stride), "cuda")
    return reductions.rebuild_cuda_tensor(
        tensor_cls, tensor_size, tensor_stride, tensor_offset, storage_cls, dtype, *rest
    )


def _rebuild_storage_filename(cls, manager, handle, size, dtype=None):
    _check_class(cls, _STORAGE_CLASSES, "rebuild_storage_filename: class")
    if not (isinstance(manager, bytes) and isinstance(handle, bytes) and isinstance(size, int) and size >= 0):
        raise _refuse("rebuild_storage_filename: arguments are not (class, manager, handle, size)")
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise _refuse(f"rebuild_storage_filename: dtype {dtype!r} is not a torch dtype")
    return reductions.rebuild_storage_filename(cls, manager, handle, size, dtype)


def _rebuild_storage_empty(cls):
    _check_class(cls, _STORAGE_CLASSES, "rebuild_storage_empty: class")
    return reductions.rebuild_storage_empty(cls)


def _rebuild_typed_storage(storage, dtype):
    if not isinstance(storage, torch.UntypedStorage) or not isinstance(dtype, torch.dtype):
        raise _refuse("rebuild_typed_storage: arguments are not (untyped storage, dtype)")
    return reductions.rebuild_typed_storage(storage, dtype)


_REBUILDERS = {
    "rebuild_tensor": _rebuild_tensor,
    "rebuild_cuda_tensor": _rebuild_cuda_tensor,
    "rebuild_storage_filename": _rebuild_storage_filename,
    "rebuild_storage_empty": _rebuild_storage_empty,
    "rebuild_typed_storage": _rebuild_typed_storage,
}
# what a payload may call (REDUCE); the record class may also be made by NEWOBJ (pickled dataclasses)
CALLABLE = {*_REBUILDERS.values(), torch.Size, types.SimpleNamespace}
ALLOWED_GLOBALS: dict[tuple[str, str], Any] = {
    **{("torch.multiprocessing.reductions", name): fn for name, fn in _REBUILDERS.items()},
    ("torch", "Tensor"): torch.Tensor,
    ("torch", "Size"): torch.Size,
    ("torch.nn.parameter", "Parameter"): torch.nn.Parameter,
    ("torch.storage", "UntypedStorage"): torch.UntypedStorage,
    ("torch", "UntypedStorage"): torch.UntypedStorage,
    ("torch.storage", "TypedStorage"): torch.TypedStorage,
    ("types", "SimpleNamespace"): types.SimpleNamespace,
    # SGLang senders pickle their own metadata dataclass; read it as a record with the same fields.
    ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata"): types.SimpleNamespace,
    ("sglang.srt.model_executor.model_runner", "FlattenedTensorMetadata"): types.SimpleNamespace,
}


def use_file_system_sharing() -> None:
    """CPU tensors cross unrelated processes only with this strategy (call on both sides)."""
    if torch.multiprocessing.get_sharing_strategy() != SHARING_STRATEGY:
        torch.multiprocessing.set_sharing_strategy(SHARING_STRATEGY)


def serialize(obj: Any) -> str:
    """Pickle `obj` with ForkingPickler (tensors become shared-memory / CUDA IPC handles), as base64."""
    use_file_system_sharing()
    buffer = io.BytesIO()
    ForkingPickler(buffer).dump(obj)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


class AllowlistUnpickler(pickle._Unpickler):
    """The pure-Python unpickler (payloads are small handles), so BUILD can be checked as well:
    BUILD on an allowed class itself would set attributes on it (`setattr(torch.TypedStorage, ...)`)."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def load_build(self) -> None:
        target = self.stack[-2]
        if not isinstance(target, types.SimpleNamespace):  # metadata records are the only objects with state
            raise pickle.UnpicklingError(f"refused to set state on {target!r}: only metadata records carry state")
        super().load_build()

    def load_reduce(self) -> None:
        if self.stack[-2] not in CALLABLE:
            raise _refuse(f"calling {self.stack[-2]!r}: a payload may call only torch's tensor-rebuild functions")
        super().load_reduce()

    def load_newobj(self) -> None:
        if self.stack[-2] is not types.SimpleNamespace:
            raise _refuse(f"making a {self.stack[-2]!r}: only metadata records may be made that way")
        super().load_newobj()

    def load_newobj_ex(self) -> None:
        raise _refuse("NEWOBJ_EX: no object of a weight payload is made that way")

    def load_inst(self) -> None:
        raise _refuse("INST/OBJ: no object of a weight payload is made that way")

    dispatch[pickle.BUILD[0]] = load_build
    dispatch[pickle.REDUCE[0]] = load_reduce
    dispatch[pickle.NEWOBJ[0]] = load_newobj
    dispatch[pickle.NEWOBJ_EX[0]] = load_newobj_ex
    dispatch[pickle.INST[0]] = load_inst
    dispatch[pickle.OBJ[0]] = load_inst

    def find_class(self, module: str, name: str) -> Any:
        allowed = ALLOWED_GLOBALS.get((module, name))
        if allowed is None and module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            allowed = getattr(torch, name)
        if allowed is None:
            raise pickle.UnpicklingError(
                f"refused global '{module}.{name}': a weight payload may only name torch's "
                "tensor-rebuild functions, tensor classes and dtypes"
            )
        return allowed


def safe_loads(data: str | bytes) -> Any:
    """Inverse of `serialize`, through the allowlist. Bad base64 raises ValueError; a refused global
    raises pickle.UnpicklingError."""
    use_file_system_sharing()
    if isinstance(data, str):
        try:
            data = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise ValueError(f"payload is not valid base64: {exc}") from exc
    payload = AllowlistUnpickler(io.BytesIO(data)).load()
    check_nesting(payload)
    return payload


_CONTAINERS = (list, tuple, dict, types.SimpleNamespace)


def _children(obj: Any) -> list[Any]:
    if isinstance(obj, (list, tuple)):
        return list(obj)
    if isinstance(obj, dict):
        return [*obj.keys(), *obj.values()]
    if isinstance(obj, types.SimpleNamespace):
        return list(vars(obj).values())
    return []


def check_nesting(obj: Any, limit: int = MAX_NESTING) -> None:
    """pickle.UnpicklingError if containers nest deeper than `limit` or contain themselves. Iterative
    (a deep payload must not exhaust the interpreter's recursion), each container visited once."""
    heights: dict[int, int] = {}  # id -> height of a container already walked
    path: list[list[Any]] = [[obj, iter(_children(obj)), 0]]  # container, its unvisited children, its height
    on_path = {id(obj)}
    while path:
        frame = path[-1]
        child = next(frame[1], path)  # `path` marks the end: no payload holds it
        if child is path:
            path.pop()
            on_path.discard(id(frame[0]))
            heights[id(frame[0])] = frame[2]
            if path:
                path[-1][2] = max(path[-1][2], frame[2] + 1)
            continue
        if not isinstance(child, _CONTAINERS):
            continue
        if id(child) in on_path:
            raise _refuse("it contains itself (a cycle): send a plain list or dict")
        height = heights.get(id(child))
        if height is None and len(path) >= limit or height is not None and len(path) + height >= limit:
            raise _refuse(f"containers nest more than {limit} deep: send a flat list of (name, tensor) or buckets")
        if height is not None:
            frame[2] = max(frame[2], height + 1)
            continue
        path.append([child, iter(_children(child)), 0])
        on_path.add(id(child))
