"""Copies of an adapter's tensors as it arrived (a LoRA engine keeps none of the sender's memory):
on the GPU it arrived on (`owned_copies`: a push from a colocated trainer, merged there next) or
on the host (an adapter read from a directory, or sent from the CPU).

An adapter sent from a GPU arrives as views of one bucket there: copied one tensor at a time, each
`.to("cpu")` is its own device-to-host transfer and wait (192 for a rank-32 adapter on q, k, v, o of
24 layers), so the bucket's bytes are copied once and the tensors viewed in the copy. On the CPU
a clone per tensor is cheaper than the views (0.5 against 0.9 ms for those 192 tensors). A host
copy of tensors that came from a GPU is pinned (`host_copies` on its own), so that its bytes come
and go at the link's speed; an adapter read on the host is copied to the weights' device when it
is merged (`copies_on`, one per storage).
"""

from __future__ import annotations

import torch

SPAN_ALIGN = 64  # bytes: a span's copy starts here, so every tensor's offset in it is whole for any dtype


def host_copies(tensors: dict[str, torch.Tensor], *, per_storage: bool | None = None) -> dict[str, torch.Tensor]:
    """Copies on the host sharing no memory with what arrived. `per_storage` (default: unless every
    tensor is on the CPU): one copy of the bytes a source storage spans for these tensors, each tensor
    a view of it with its own offset, shape and stride (tensors of a storage they fill less than half
    of are copied one by one); else one clone each. Pinned where the tensors came from a GPU."""
    from_gpu = any(t.device.type == "cuda" for t in tensors.values())
    if not (per_storage if per_storage is not None else any(t.device.type != "cpu" for t in tensors.values())):
        return {key: tensor.detach().clone() for key, tensor in tensors.items()}
    return _per_storage(tensors, torch.device("cpu"), pin=from_gpu)


def owned_copies(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Copies sharing no memory with what arrived, where it arrived: an adapter sent from a GPU stays
    on it (one device copy per source storage, finished before this returns: the sender reuses its
    buffer once the engine answered), so a merge reads it in place instead of copying it back (the
    load's parse phase, which held the pinned host copy, was 4.0-4.1 ms of a rank-32 load's 7.4 on an
    H100; the change has not been timed against it on one machine). Anything else: `host_copies`."""
    devices = {t.device for t in tensors.values()}
    if len(devices) != 1 or next(iter(devices)).type != "cuda":
        return host_copies(tensors)
    (device,) = devices
    owned = _per_storage(tensors, device, pin=False)
    torch.cuda.current_stream(device).synchronize()
    return owned


def copies_on(tensors: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """`tensors` on `device`: one copy of each source storage's span (host_copies' views), not one
    transfer and wait per tensor; the tensors themselves where they are on `device` already."""
    if all(t.device == device for t in tensors.values()):
        return dict(tensors)
    return _per_storage(tensors, device, pin=False)


def _per_storage(tensors: dict[str, torch.Tensor], device: torch.device, pin: bool) -> dict[str, torch.Tensor]:
    groups: dict[tuple[int, str], list[str]] = {}
    for key, tensor in tensors.items():
        pointer = tensor.untyped_storage().data_ptr() if tensor.numel() else 0
        groups.setdefault((pointer, str(tensor.device)), []).append(key)
    owned = {}
    for (pointer, _), keys in groups.items():
        spans = {key: _byte_span(tensors[key]) for key in keys} if pointer else {}
        start = min((first for first, _ in spans.values()), default=0) // SPAN_ALIGN * SPAN_ALIGN
        end = max((last for _, last in spans.values()), default=0)
        if not pointer or end - start > 2 * sum(last - first for first, last in spans.values()):
            owned.update({key: tensors[key].detach().to(device, copy=True) for key in keys})
            continue
        first = tensors[keys[0]]
        storage = torch.empty(0, dtype=torch.uint8, device=first.device).set_(first.untyped_storage())
        copy = torch.empty(end - start, dtype=torch.uint8, device=device, pin_memory=pin)
        copy.copy_(storage[start:end], non_blocking=device.type == "cuda")  # queued behind the step before
        for key in keys:
            tensor, (offset, _) = tensors[key], spans[key]
            element = tensor.element_size()
            owned[key] = torch.empty(0, dtype=tensor.dtype, device=device).set_(
                copy.untyped_storage(), (offset - start) // element, tensor.shape, tensor.stride()
            )
    return owned


def _byte_span(tensor: torch.Tensor) -> tuple[int, int]:
    """The bytes of its storage a non-empty tensor reads: [first, end)."""
    last = tensor.storage_offset() + sum((n - 1) * step for n, step in zip(tensor.shape, tensor.stride()))
    return tensor.storage_offset() * tensor.element_size(), (last + 1) * tensor.element_size()
