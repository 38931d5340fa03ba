"""The weights' storages of one rank, for release and resume: each parameter owns a resizable storage
(freed by resizing it to 0, allocated again at its size), and with --enable-weights-cpu-backup a host
copy of the released weights (`HostCopy`) that a resume puts back byte for byte."""

from __future__ import annotations

import torch

from rollfleet.engine.tp.shards import local_of

Storages = list[tuple[torch.UntypedStorage, int]]  # (storage, bytes when resident)


@torch.no_grad()
def own_storages(params: dict[str, torch.Tensor]) -> None:
    """Give every parameter a storage of its own: loaded tensors may alias a file buffer, which
    cannot be resized, and release/resume frees and re-allocates storages in place."""
    for param in {id(p): p for p in params.values()}.values():
        local = local_of(param)
        if not local.untyped_storage().resizable():
            local.set_(local.clone())


def unique_storages(params: dict[str, torch.Tensor]) -> Storages:
    seen: dict[int, tuple[torch.UntypedStorage, int]] = {}
    for param in params.values():
        storage = local_of(param).untyped_storage()
        seen.setdefault(storage.data_ptr(), (storage, storage.nbytes()))
    return list(seen.values())


class HostCopy:
    """Released weights' bytes on the host, until a resume restores them or a load replaces them."""

    def __init__(self):
        self._copies: list[torch.UntypedStorage] | None = None

    def take(self, storages: Storages, *, pin: bool) -> None:
        """A new storage per weight storage (on the CPU too, where `.cpu()` would alias it); `pin`: in
        page-locked memory, which the GPU copies from and back at full speed."""
        self._copies = [
            torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pin).untyped_storage().copy_(storage)
            for storage, _ in storages
        ]

    def restore(self, storages: Storages) -> bool:
        """Put the bytes back into the (allocated) storages and let the copy go; False if there was none."""
        copies, self._copies = self._copies, None
        for (storage, _), copy in zip(storages, copies or []):
            storage.copy_(copy)
        return copies is not None

    def drop(self) -> None:
        self._copies = None

    def stats(self) -> dict:
        copies = self._copies or []
        return {
            "host_copy_bytes": sum(copy.nbytes() for copy in copies),
            "host_copy_pinned": bool(copies) and all(copy.is_pinned() for copy in copies),
        }
