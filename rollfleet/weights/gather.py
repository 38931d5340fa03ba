"""Full tensors out of FSDP2 shards, many parameters per collective, cast to the engines' dtype first.

`DTensor.full_tensor()` is one collective (plus DTensor's dispatch) per parameter: a 1.5B model has
about 270 of them, and on 2 x H200 they took 0.2 s of a 0.24 s push for 3 GB that NVLink moves in
about 10 ms. `ShardGather` gathers the row shards of every FSDP2 parameter of several decoder
layers in ONE `all_gather_into_tensor` of a flat buffer:

    rank r's buffer:  [p1 rows of r, padded to ceil(n1/world)] [p2 rows of r, padded] ...
    gathered:         rank 0's buffer | rank 1's buffer | ...
    full p1 = cat(p1's rows from each rank's part)

FSDP2 splits dim 0 as `torch.chunk` does (rank r holds rows [r*c, min((r+1)*c, n)), c = ceil(n/world),
possibly none), so every rank knows every other rank's row count from the global shape alone.

Each local shard is cast to the engines' dtype BEFORE it enters the buffer: the collective and
everything after it move engine-sized bytes (half of the fp32 master weights for bf16 engines). A
cast of a shard then a gather gives the same values as a gather then a cast (casts are elementwise).

Parameters that are not FSDP2 row shards (tensor-parallel placements, 2-D meshes, plain tensors)
keep the exact path: cast, then `full_tensor()` for a DTensor. Every rank runs the same collectives
in the same order (the order of `named_parameters`), whatever it keeps.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

# Gathered bytes per collective (whole layers; a larger layer goes alone). On a GPU, NCCL's cost per
# collective dominates: few large ones. On CPU (gloo over loopback) bytes dominate and buffers past
# glibc's mmap threshold are mapped and faulted in afresh each time: measured with
# a one-off script (docs/benchmarks.md: "Trainer source"; 127 MB model, world 2, loaded 2-core machine) 16 MB per gather
# took 0.45 s, 64 MB 1.9 s, 256 MB 2.9 s, one full_tensor per parameter 0.55 s.
GATHER_BYTES = {"cuda": 256 << 20, "cpu": 16 << 20}


def default_gather_bytes(device: torch.device) -> int:
    return GATHER_BYTES.get(device.type, GATHER_BYTES["cuda"])


def is_row_sharded(param: torch.Tensor) -> bool:
    """An FSDP2 parameter: a DTensor on a 1-D mesh split along dim 0 (not a strided split)."""
    if not isinstance(param, DTensor) or param.device_mesh.ndim != 1 or param.dim() == 0 or param.shape[0] == 0:
        return False
    placements = tuple(param.placements)
    return len(placements) == 1 and type(placements[0]) is Shard and placements[0].dim == 0


class ShardGather:
    """Gathers layers of parameters into full tensors in `dtype` (None: their own dtype).

    `keep=False` (a rank that takes part in the gathers but sends nothing): the collectives run,
    the full tensors are not assembled, and the dicts it yields hold None. `defer_cast=True`: a
    tensor that needs no collective (a plain tensor, or a shard on a mesh of one rank) comes as it
    is, a view, NOT cast: its caller casts it as it copies it anyway (the tensor transport, into its
    bucket), which saves a copy of the model and one kernel launch per parameter (one H100, a 4.16 GB
    push from an fp32 trainer: the source phase 10 ms of a 40 ms push, 8 ms of it the casts'
    launches, and the casts 4.5 of its 9.3 ms of device work)."""

    def __init__(self, dtype: torch.dtype | None = None, *, keep: bool = True, defer_cast: bool = False):
        self.dtype, self.keep, self.defer_cast = dtype, keep, defer_cast

    @staticmethod
    def gathered_bytes(param: torch.Tensor, dtype: torch.dtype | None) -> int:
        """Bytes of `param`'s full tensor once cast to `dtype` (floating parameters only)."""
        cast = dtype is not None and param.is_floating_point()
        return param.numel() * (dtype.itemsize if cast else param.element_size())

    def cast(self, tensor: torch.Tensor, *, local: bool = False) -> torch.Tensor:
        """`tensor` in `dtype`; `local`: a tensor that needs no collective (see `defer_cast`)."""
        return self._cast_detached(tensor.detach(), local)

    def _cast_detached(self, tensor: torch.Tensor, local: bool) -> torch.Tensor:
        if self.dtype is None or (local and self.defer_cast) or not tensor.is_floating_point():
            return tensor
        return tensor.to(self.dtype)

    def _one_rank(self, local: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """A row-sharded parameter's detached shard on a mesh of one rank, as its full tensor."""
        full = self._cast_detached(local, local=True)
        return full if full.shape == shape else full.view(shape)

    def full_tensors(self, layers: list[dict[str, torch.Tensor]]) -> Iterator[dict[str, torch.Tensor | None]]:
        """Each layer's full tensors (name -> tensor, in the layer's order), the row-sharded ones of
        all `layers` gathered together first."""
        rows = [(i, name, p) for i, layer in enumerate(layers) for name, p in layer.items() if is_row_sharded(p)]
        gathered = self._gather_rows(rows)
        for index, layer in enumerate(layers):
            out: dict[str, torch.Tensor | None] = {}
            for name, param in layer.items():
                if (index, name) in gathered:
                    out[name] = gathered[index, name]
                elif isinstance(param, DTensor):
                    out[name] = self.cast(param).full_tensor()  # collective: every rank, same order
                else:
                    out[name] = self.cast(param, local=True)
            yield out

    def _gather_rows(self, rows: list[tuple[int, str, DTensor]]) -> dict[tuple[int, str], torch.Tensor | None]:
        """One all-gather per (process group, dtype) of these row-sharded parameters. On a mesh of
        one rank the shard is the full tensor: cast (a view when no cast is needed), never gathered."""
        groups: dict[tuple, list] = {}
        group_of: dict[int, object] = {}  # mesh -> its process group, looked up once per mesh
        for index, name, param in rows:
            # the shard itself: DTensor.to_local() is an autograd function's dispatch (9 us a
            # parameter on the CPU, a quarter of a push's source time at 267 tensors)
            local = param._local_tensor.detach()
            dtype = self.dtype if self.dtype is not None and local.is_floating_point() else local.dtype
            mesh = param.device_mesh
            if id(mesh) not in group_of:
                group_of[id(mesh)] = mesh.get_group()
            key = (group_of[id(mesh)], dtype, local.device)  # meshes alike share one group
            groups.setdefault(key, []).append((index, name, param, local))
        out: dict[tuple[int, str], torch.Tensor | None] = {}
        for (_, dtype, _), members in groups.items():
            mesh = members[0][2].device_mesh
            if mesh.size() == 1:  # (`local` is detached: a second detach and a same-shape view were 2 dispatches each)
                fulls = [self._one_rank(local, p.shape) if self.keep else None for *_, p, local in members]
            else:
                fulls = _all_gather_rows([(p.shape, local) for _, _, p, local in members], mesh, self.keep, dtype)
            out.update({(index, name): full for (index, name, _, _), full in zip(members, fulls)})
        return out


def _all_gather_rows(
    shards: list[tuple[torch.Size, torch.Tensor]], mesh, keep: bool, dtype: torch.dtype
) -> list[torch.Tensor | None]:
    """Full tensors in `dtype` of `shards` (global shape, this rank's rows), in one all-gather over
    `mesh`; each shard is cast as it is copied into the rank's buffer (no cast copy of its own)."""
    world, rank = mesh.size(), mesh.get_local_rank()
    layout = []  # per shard: (offset in a rank's part, elements per row, rows per rank)
    offset = 0
    for shape, _ in shards:
        per_row = shape[1:].numel()
        chunk = -(-shape[0] // world)
        counts = [max(0, min(chunk, shape[0] - r * chunk)) for r in range(world)]
        layout.append((offset, per_row, counts))
        offset += chunk * per_row
    device = shards[0][1].device
    mine = torch.empty(offset, dtype=dtype, device=device)  # padding rows are sent but never read
    for (start, per_row, counts), (_, local) in zip(layout, shards):
        assert local.shape[0] == counts[rank], f"rank {rank} holds {local.shape[0]} rows, FSDP2 gives {counts[rank]}"
        mine[start : start + counts[rank] * per_row].copy_(local.reshape(-1))
    everyone = torch.empty(world * offset, dtype=dtype, device=device)
    dist.all_gather_into_tensor(everyone, mine, group=mesh.get_group())
    if not keep:
        return [None] * len(shards)
    fulls = []
    for (start, per_row, counts), (shape, _) in zip(layout, shards):
        parts = [everyone[r * offset + start : r * offset + start + counts[r] * per_row] for r in range(world)]
        fulls.append(torch.cat(parts).view(shape))
    return fulls
