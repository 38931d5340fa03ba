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
tensors, the classes and dtypes they need, `types.SimpleNamespace` (bucket metadata records) and
`LocalSerializedTensor` (SGLang's per-tp-rank wrapper, which verl sends) may be named by the
payload, and only those records may receive state (BUILD); anything else raises
`pickle.UnpicklingError` naming what was refused. Unpickling an arbitrary payload would be
remote code execution (CVE-2025-10164 in SGLang).
Named is not called: the payload may call only the rebuild functions, `torch.Size` and the record
class. The tensor and storage classes are arguments of the rebuild functions, never callable
themselves (`torch.UntypedStorage(n)` and `torch.Tensor(n)` allocate uninitialised memory). The
rebuild functions are called through checks: a tensor must lie inside the storage the payload
carried (`set_` would otherwise grow an empty storage over uninitialised heap memory). A payload
nested deeper than MAX_NESTING (or cyclic) is refused before anything reads it.
The reader is pickle's C unpickler (a 267-record payload: under 1 ms; the pure-Python one, which
checked each opcode, took 4-20 ms), naming only the allowlist: everything else a payload can reach
while it is read is inert by construction (rollfleet/wire/unpickled.py says how), and the record
classes are the only types it names (NEWOBJ makes only types): SimpleNamespace, immutable, and a
LocalSerializedTensor class that refuses arguments and is never called.
CUDA tensors name their device by index (torch) or by the GPU's UUID: SGLang's senders (slime, verl,
XTuner, UniRL) call its `monkey_patch_torch_reductions`, which pickles the UUID and names
`sglang.srt.utils.patch_torch._rebuild_cuda_tensor_modified`; `serialize` writes the UUID too (under
torch's own name, which SGLang >= 0.5.21 patches before it unpickles), because an index means
another GPU in a process whose CUDA_VISIBLE_DEVICES differs (torch issue 149248). The reader maps
a UUID to its own device index and refuses one it cannot see.
A payload can still name any shared-memory file or CUDA IPC handle of the same user: guard the
routes that accept payloads with an API key when the port is reachable by others.

One job: the payload's round trip. The allowlist accepts exactly what `serialize` writes (its rebuild
functions, the CUDA device named by UUID, the file-system sharing), so the writer and the reader change
together, in one file.
"""

from __future__ import annotations

import base64
import binascii
import functools
import io
import pickle
import types
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing
from torch.multiprocessing import reductions  # importing it registers torch's reductions with ForkingPickler

from rollfleet.wire.unpickled import Call, Named, Rebuild, settled
from rollfleet.wire.unpickled import refuse as _refuse

SHARING_STRATEGY = "file_system"
# torch's own, even if SGLang's monkey_patch_torch_reductions replaced the module's attribute later
_TORCH_REBUILD_CUDA_TENSOR = reductions.rebuild_cuda_tensor
MAX_NESTING = 32  # real payloads nest 5 deep: list -> bucket dict -> metadata list -> record -> shape
_STORAGE_CLASSES = (torch.UntypedStorage, torch.TypedStorage)
_TENSOR_CLASSES = (torch.Tensor, torch.nn.Parameter)


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


CUDA_DEVICE_ARG = 6  # where torch's CUDA tensor reduction puts the device (SGLang's patch relies on it too)


def cuda_device_index(device: Any, uuids: list[str]) -> int:
    """The local index of the device a CUDA payload names: an index as is, a UUID (SGLang's patched
    reduction, and `serialize`) looked up in `uuids`, this process's devices in index order."""
    if isinstance(device, bool) or not isinstance(device, (int, str)):
        raise _refuse(f"rebuild_cuda_tensor: device {device!r} is neither a device index nor a GPU UUID")
    if isinstance(device, str):
        if device not in uuids:
            raise _refuse(
                f"rebuild_cuda_tensor: GPU {device} is not visible to this process (its GPUs: {uuids}): "
                "CUDA IPC handles work only between processes on the same host that both see the GPU"
            )
        return uuids.index(device)
    if not 0 <= device < len(uuids):
        raise _refuse(f"rebuild_cuda_tensor: device index {device}, this process has {len(uuids)} CUDA devices")
    return device


@functools.cache
def visible_cuda_uuids() -> list[str]:
    """UUIDs of this process's CUDA devices in index order ([] without CUDA), as SGLang writes them."""
    if not torch.cuda.is_available():
        return []
    return [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]


def _rebuild_cuda_tensor(tensor_cls, tensor_size, tensor_stride, tensor_offset, storage_cls, dtype, *rest):
    """torch's rebuild_cuda_tensor through checks; the device may be an index or a GPU UUID."""
    _check_class(tensor_cls, _TENSOR_CLASSES, "rebuild_cuda_tensor: class")
    _check_class(storage_cls, _STORAGE_CLASSES, "rebuild_cuda_tensor: storage class")
    if not isinstance(dtype, torch.dtype) or len(rest) != 9 or not isinstance(rest[2], int):
        raise _refuse("rebuild_cuda_tensor: arguments are not those torch pickles for a CUDA tensor")
    storage_bytes = rest[2] if rest[1] is not None else 0  # storage_size_bytes; no handle = empty storage
    _check_extent(storage_bytes, dtype.itemsize, tensor_offset, tuple(tensor_size), tuple(tensor_stride), "cuda")
    device = cuda_device_index(rest[0], visible_cuda_uuids())
    return _TORCH_REBUILD_CUDA_TENSOR(
        tensor_cls, tensor_size, tensor_stride, tensor_offset, storage_cls, dtype, device, *rest[1:]
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


class LocalSerializedTensor:
    """SGLang's LocalSerializedTensor, which verl puts in place of each tensor of a
    `/update_weights_from_tensor` payload: `values[i]` is tp rank i's own serialized tensor (raw
    ForkingPickler bytes or base64), and each rank reads only its own (`get(rank)`), so every
    shared handle is opened once. The inner payload goes through the same allowlist and must be a tensor."""

    values: tuple[bytes | str, ...] = ()
    _tensor: tuple[int, torch.Tensor] | None = None  # (rank, its tensor) once read

    def __init__(self, values: list[bytes | str]):
        self.__setstate__({"values": values})

    def __setstate__(self, state: Any) -> None:
        """BUILD from a payload: a dataclass's state, `{"values": [bytes or str per tp rank]}`."""
        values = state.get("values") if isinstance(state, dict) and set(state) == {"values"} else None
        if not isinstance(values, list) or not all(isinstance(v, (bytes, str)) for v in values):
            raise _refuse("a LocalSerializedTensor's state must be {'values': [one serialized tensor per tp rank]}")
        self.values = tuple(values)  # a copy: the payload cannot change it after this check
        self._tensor = None

    def get(self, rank: int) -> torch.Tensor:
        """Rank `rank`'s tensor, read once (later calls return the same tensor)."""
        if not 0 <= rank < len(self.values):
            raise _refuse(
                f"a LocalSerializedTensor holds {len(self.values)} values, tp rank {rank} has none: "
                "give one value per tp rank of the engine"
            )
        if self._tensor is None or self._tensor[0] != rank:
            tensor = safe_loads(self.values[rank])
            if not isinstance(tensor, torch.Tensor):
                raise _refuse(f"LocalSerializedTensor.values[{rank}] holds a {type(tensor).__name__}, not a tensor")
            self._tensor = (rank, tensor)
        return self._tensor[1]


class _LocalSerializedTensorRecord(LocalSerializedTensor):
    """LocalSerializedTensor as a payload makes it (a pickled dataclass): NEWOBJ without arguments,
    then BUILD through its checked `__setstate__`; never called."""

    def __new__(cls, *args: Any, **kwargs: Any):
        if args or kwargs:
            raise _refuse(f"making a {cls.__name__} with arguments: only metadata records may be made that way")
        return super().__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any):  # REDUCE: NEWOBJ does not call it
        raise _refuse("calling LocalSerializedTensor: a payload may call only torch's tensor-rebuild functions")


# the record classes: real types, since NEWOBJ makes only types (pickled dataclasses), and nothing else
# the payload names is one; SimpleNamespace is immutable, the LocalSerializedTensor class's own
# `__setstate__` refuses a call without an instance (BUILD on the class passes the state alone)
_RECORD = types.SimpleNamespace
_LST = _LocalSerializedTensorRecord
ALLOWED_GLOBALS: dict[tuple[str, str], Any] = {
    **{("torch.multiprocessing.reductions", name): Rebuild(fn) for name, fn in _REBUILDERS.items()},
    ("torch", "Tensor"): Named(torch.Tensor),
    ("torch", "Size"): Call(torch.Size),
    ("torch.nn.parameter", "Parameter"): Named(torch.nn.Parameter),
    ("torch.storage", "UntypedStorage"): Named(torch.UntypedStorage),
    ("torch", "UntypedStorage"): Named(torch.UntypedStorage),
    ("torch.storage", "TypedStorage"): Named(torch.TypedStorage),
    ("types", "SimpleNamespace"): _RECORD,
    # SGLang's patched CUDA rebuild (device by UUID): the same checked rebuild, which takes both
    ("sglang.srt.utils.patch_torch", "_rebuild_cuda_tensor_modified"): Rebuild(_rebuild_cuda_tensor),
    # SGLang senders pickle their own metadata dataclass; read it as a record with the same fields.
    ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata"): _RECORD,
    ("sglang.srt.model_executor.model_runner", "FlattenedTensorMetadata"): _RECORD,
    # verl wraps each tensor in SGLang's LocalSerializedTensor (its module moved in 0.5.2x)
    ("sglang.srt.model_executor.model_runner_components.weight_updater", "LocalSerializedTensor"): _LST,
    ("sglang.srt.model_executor.model_runner", "LocalSerializedTensor"): _LST,
    **{("torch", name): dtype for name, dtype in vars(torch).items() if isinstance(dtype, torch.dtype)},
}


def use_file_system_sharing() -> None:
    """CPU tensors cross unrelated processes only with this strategy (call on both sides)."""
    if torch.multiprocessing.get_sharing_strategy() != SHARING_STRATEGY:
        torch.multiprocessing.set_sharing_strategy(SHARING_STRATEGY)


def shared_cpu_buffer(nbytes: int) -> torch.Tensor:
    """A uint8 CPU buffer in shared memory as `serialize` shares it. Serializing a tensor that is not
    yet shared moves its storage there (a copy, then the old memory freed): a thread reading the
    tensor meanwhile reads freed memory (the lora transport's directory writer wrote a changed
    first tensor that way). A buffer made here is never moved."""
    use_file_system_sharing()
    return torch.empty(nbytes, dtype=torch.uint8).share_memory_()


def with_device_uuid(args: tuple, uuids: list[str]) -> tuple:
    """torch's reduction of a CUDA tensor with its device index replaced by the GPU's UUID (as SGLang's
    `monkey_patch_torch_reductions` does); a UUID already there stays."""
    device = args[CUDA_DEVICE_ARG]
    if isinstance(device, str):
        return args
    return (*args[:CUDA_DEVICE_ARG], uuids[device], *args[CUDA_DEVICE_ARG + 1 :])


class _UuidPickler(ForkingPickler):
    """ForkingPickler that names a CUDA tensor's device by UUID: the receiving process may number
    its GPUs differently (another CUDA_VISIBLE_DEVICES)."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor) and obj.is_cuda:
            rebuild, args = reductions.reduce_tensor(obj)
            return rebuild, with_device_uuid(args, visible_cuda_uuids())
        return NotImplemented


def serialize(obj: Any) -> str:
    """Pickle `obj` with ForkingPickler (tensors become shared-memory / CUDA IPC handles; a CUDA
    tensor's device is named by UUID), as base64."""
    use_file_system_sharing()
    buffer = io.BytesIO()
    _UuidPickler(buffer).dump(obj)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


class AllowlistUnpickler(pickle.Unpickler):
    """pickle's C unpickler, naming only the allowlist (what it returns is inert: module docstring).
    `load()` leaves holders in place: `safe_loads` is the reader."""

    def find_class(self, module: str, name: str) -> Any:
        allowed = ALLOWED_GLOBALS.get((module, name))
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
    return settled(AllowlistUnpickler(io.BytesIO(data)).load(), _LEAVES, MAX_NESTING)


# what cannot hold a container or a token (torch.Size: ints only; the record's values were checked)
_LEAVES = frozenset({str, bytes, bytearray, int, float, bool, type(None), torch.dtype, torch.Size, _LST})
