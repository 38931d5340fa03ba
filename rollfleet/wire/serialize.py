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

_REBUILDERS = (
    "rebuild_tensor",
    "rebuild_cuda_tensor",
    "rebuild_storage_filename",
    "rebuild_storage_empty",
    "rebuild_typed_storage",
)
ALLOWED_GLOBALS: dict[tuple[str, str], Any] = {
    **{("torch.multiprocessing.reductions", name): getattr(reductions, name) for name in _REBUILDERS},
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

    dispatch[pickle.BUILD[0]] = load_build

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
    return AllowlistUnpickler(io.BytesIO(data)).load()
