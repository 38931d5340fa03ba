"""The tensor transport's resident path: a one-rank trainer's parameters mapped into the engines
once, each later push an id.

Why: a packed push (transports/tensor.py) copies every tensor into a bucket, hands the bucket over
and has the engine unpack and copy it again, every push: on one H100 host a same-GPU push of 4.16
GB took 28-30 ms, of which the two copies are ~5.5 ms and the rest per-call host work on both
sides. Here the first push sends the parameters themselves (CUDA IPC / shared-memory handles of
their storages, load_format "rollfleet_resident", `{"mapping": id, "tensors": pairs}`); the engine
keeps what it rebuilt under that id, and every later push is one call carrying the id alone
(`"tensors": None`), answered after the engine copied (and cast) the kept tensors into its weights:
one copy per push, no bucket, no unpickling of handles.

When (every condition, else the packed path): `weight_sync.resident` (default true); one sender
rank; every target an embedded engine that says `rollfleet_resident_weights` and takes sessions; a
source that says its parameters stay (`ModuleSource(stays=True)`: the trainer when it does not
offload) and whose every tensor is a view of a parameter's storage (checked at every push: a
conversion or cast that copies goes the packed way).

Which engines get the tensors: those whose `/begin_weight_update` answer names another mapping
than ours (a restarted engine holds none), and all of them when any tensor's place changed (a new
signature: storage address, offset, shape, stride, dtype, device), which also makes a new id.

Memory: an engine holding the mapping holds references to the trainer's parameter storages; a
storage the trainer freed would stay allocated (CUDA IPC) until the engine let go, which is why a
source whose parameters move (offload) is never mapped. Order: the sender waits for its device
before the call (the engine reads the parameters on its own stream, and a kept mapping carries no
IPC event), and the engine answers after its copies ended, so the trainer may step once the push
returned. On the CPU the first push moves each parameter's storage into shared memory (in place:
the parameter keeps working, later writes land where the engine reads)."""

from __future__ import annotations

import uuid

import torch

from rollfleet.wire.serialize import serialize


def resident_capable(server_info: dict) -> bool:
    return server_info.get("rollfleet_resident_weights") is True


def signature(named: list[tuple[str, torch.Tensor]]) -> tuple:
    """Where every tensor lies: a change means the engines' kept mapping is stale."""
    return tuple(
        (name, t.untyped_storage().data_ptr(), t.storage_offset(), t.dtype, t.shape, t.stride(), t.device)
        for name, t in named
    )


def outside(named: list[tuple[str, torch.Tensor]], storages: set[int]) -> list[str]:
    """Names of the tensors that are not views of one of `storages` (a copy made for the push)."""
    return [name for name, t in named if t.untyped_storage().data_ptr() not in storages]


class ResidentMapping:
    """One sender's mapping: its id and signature, and which engine holds which id."""

    def __init__(self):
        self.id: str | None = None
        self.signature: tuple | None = None
        # the last push's (source key, tensors): a push of the same model with the same parameter
        # layout reuses its views instead of walking the source again (5-6 ms of an FSDP2 source)
        self._last: tuple | None = None

    def tensors_of(self, source, tensors) -> tuple[list, list[str]]:
        """`(the source's tensors as a list, the names of those that are not views of a parameter)`;
        `tensors`, the source's iterator, is only walked when the layout changed."""
        key = (source.model, source.dtype, source.parameter_layout())
        if self._last is not None and self._last[0] == key:
            return self._last[1], []
        self._last = None
        named = list(tensors)
        stray = outside(named, source.parameter_storages())
        if named and not stray:
            self._last = (key, named)
        return named, stray

    def entries(self, named: list, held: dict[int, str | None], ranks: dict[int, int]) -> tuple[dict, list[int]]:
        """Each engine's entries (one serialization per engine rank) and the engines sent tensors.
        `held`: engine id -> the mapping it says it keeps; `ranks`: engine id -> its rank count.
        Call `adopt` once every engine loaded them."""
        if self.signature != signature(named):
            self.id, self.signature = uuid.uuid4().hex, None
        sent = [engine for engine in ranks if self.signature is None or held.get(engine) != self.id]
        pairs = [(name, tensor.detach()) for name, tensor in named] if sent else []
        entries = {
            engine: [
                serialize({"mapping": self.id, "tensors": pairs if engine in sent else None}) for _ in range(count)
            ]
            for engine, count in ranks.items()
        }
        return entries, sent

    def adopt(self, named: list) -> None:
        """Every engine loaded this push: the signature is read after serializing (on the CPU the
        first serialization moved the storages into shared memory)."""
        self.signature = signature(named)

    def forget(self) -> None:
        """A push failed: the engines' state is unknown, the next push maps again."""
        self.id, self.signature, self._last = None, None, None
