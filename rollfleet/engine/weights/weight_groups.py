"""Weight-update groups: process groups a sender (group rank 0) broadcasts full tensors on, for
`/update_weights_from_distributed`. Joined on every rank of the engine or on none."""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from rollfleet.engine.tp.payloads import first_line
from rollfleet.engine.tp.ranks import Ranks
from rollfleet.wire.buckets import dtype_from_name, view_bytes_as
from rollfleet.wire.group import join_weight_update_group

log = logging.getLogger("rollfleet.engine")
WEIGHT_GROUP_BACKENDS = ("nccl", "gloo")
Spec = tuple[str, torch.dtype, tuple[int, ...]]


class WeightUpdateError(ValueError):
    """A weight update was refused before any parameter changed."""


@dataclass
class WeightGroup:
    """A joined weight-update group: broadcasts from its rank 0 arrive on `device`."""

    group: dist.ProcessGroup
    rank: int
    world_size: int
    device: torch.device
    # GPU receives run on a stream of their own: a broadcast launched from the default stream would
    # wait for the previous call's copy into the parameters, leaving the wire idle during each copy
    stream: torch.cuda.Stream | None = None


def parse_specs(names: list[str], dtypes: list[str], shapes: list[list[int]]) -> list[Spec]:
    """(name, dtype, shape) per tensor of a distributed update; WeightUpdateError when the metadata
    cannot say how many bytes the sender broadcasts."""
    if not len(names) == len(dtypes) == len(shapes):
        raise WeightUpdateError(
            f"names ({len(names)}), dtypes ({len(dtypes)}) and shapes ({len(shapes)}) must have "
            "the same length; nothing was received, so the sender's broadcast is left waiting "
            "until the group times out: destroy the group and init a new one"
        )
    specs = []
    for name, dtype, shape in zip(names, dtypes, shapes):
        try:
            dtype = dtype_from_name(dtype)
        except ValueError as exc:
            raise WeightUpdateError(
                f"{name}: {exc}; nothing was received, so the sender's broadcast is left "
                "waiting until the group times out: destroy the group and init a new one"
            ) from exc
        if any(d < 0 for d in shape):
            raise WeightUpdateError(
                f"{name}: shape {shape} has a negative size; nothing was received, so the sender's "
                "broadcast is left waiting until the group times out"
            )
        specs.append((name, dtype, tuple(shape)))
    return specs


class WeightGroups:
    def __init__(self, ranks: Ranks, tp_size: int, device: torch.device):
        self.ranks, self.tp_size, self.device = ranks, tp_size, device
        self.joined: dict[str, WeightGroup] = {}

    def join(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
        timeout_s: float,
    ) -> None:
        """Join group `group_name` as rank `rank_offset + tp_rank`, on every rank or on none."""
        ranks = list(range(rank_offset, rank_offset + self.tp_size))
        where = (
            f"weight update group {group_name!r} at tcp://{master_address}:{master_port} "
            f"(world_size={world_size}, this engine's ranks {ranks})"
        )
        refusal, joined = None, None
        if group_name in self.joined:
            refusal = f"{where} is already initialized: call /destroy_weights_update_group first"
        elif rank_offset < 1 or rank_offset + self.tp_size > world_size:
            refusal = (
                f"{where}: the engine's ranks must lie in 1..world_size-1 (rank 0 is the sender): "
                f"give rank_offset >= 1 and world_size >= rank_offset + tp_size ({self.tp_size})"
            )
        elif backend not in WEIGHT_GROUP_BACKENDS:
            refusal = f"{where}: backend={backend!r}: use one of {list(WEIGHT_GROUP_BACKENDS)}"
        else:
            rank = rank_offset + self.ranks.rank
            try:
                joined = self._join(master_address, master_port, rank, world_size, group_name, backend, timeout_s)
            except (RuntimeError, ValueError) as exc:  # DistStoreError / DistNetworkError on timeout
                refusal = f"rank {rank}: {first_line(exc)}"

        def explain(refusals: list[str]) -> str:
            if all(r.startswith("rank ") for r in refusals):
                return (
                    f"could not join {where} within {timeout_s:g} s; group rank 0 (the sender) "
                    f"must join at the same time: {'; '.join(refusals)}"
                )
            return "; ".join(refusals)

        try:
            self.ranks.agree(refusal, WeightUpdateError, explain)
        except WeightUpdateError:
            if joined is not None:  # another rank failed: leave no half-joined group behind
                self.joined.pop(group_name)
                dist.destroy_process_group(joined.group)
            raise

    def _join(self, master_address, master_port, rank, world_size, group_name, backend, timeout_s) -> WeightGroup:
        if backend == "nccl" and self.device.type == "cpu":
            log.warning(
                "weight update group %r: backend 'nccl' on a CPU engine, using 'gloo' (the sender must use gloo too)",
                group_name,
            )
            backend = "gloo"
        group = join_weight_update_group(
            master_address, master_port, rank, world_size, group_name, backend, timedelta(seconds=timeout_s)
        )
        device = self.device if backend == "nccl" else torch.device("cpu")
        stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.joined[group_name] = WeightGroup(group, rank, world_size, device, stream)
        return self.joined[group_name]

    def destroy(self, group_name: str) -> None:
        group = self.joined.pop(group_name, None)
        if group is None:
            have = sorted(self.joined)
            raise WeightUpdateError(f"no weight update group {group_name!r} on this engine (have {have})")
        dist.destroy_process_group(group.group)

    def get(self, group_name: str) -> WeightGroup:
        group = self.joined.get(group_name)
        if group is None:
            raise WeightUpdateError(
                f"no weight update group {group_name!r} on this engine (have "
                f"{sorted(self.joined)}): call /init_weights_update_group first"
            )
        return group

    def receive(self, group_name: str, specs: list[Spec], load_format: str | None) -> dict[str, torch.Tensor]:
        """The tensors `specs` announce, as the sender broadcasts them (see WeightUpdater.from_distributed)."""
        group = self.get(group_name)
        try:
            if load_format == "flattened_bucket":
                return self._receive_flat(group, specs)
            tensors = {}
            for name, dtype, shape in specs:
                tensors[name] = torch.empty(shape, dtype=dtype, device=group.device)
                dist.broadcast(tensors[name], group=group.group, group_src=0)
            return tensors
        except RuntimeError as exc:  # a broadcast that timed out or lost a peer (DistBackendError)
            raise WeightUpdateError(
                f"receiving from weight update group {group_name!r} failed, nothing changed: "
                f"{first_line(exc)}; the group may be unusable now: destroy it and init a new "
                "one"
            ) from exc

    @staticmethod
    def _receive_flat(group: WeightGroup, specs: list[Spec]) -> dict[str, torch.Tensor]:
        sizes = [math.prod(shape) * dtype.itemsize for _, dtype, shape in specs]
        with torch.cuda.stream(group.stream) if group.stream is not None else contextlib.nullcontext():
            flat = torch.empty(sum(sizes), dtype=torch.uint8, device=group.device)
            dist.broadcast(flat, group=group.group, group_src=0)
        if group.stream is not None:  # the copies (default stream) start once the bytes landed
            torch.cuda.current_stream(group.device).wait_stream(group.stream)
            flat.record_stream(torch.cuda.current_stream(group.device))  # freed only after they read it
        if len({dtype for _, dtype, _ in specs}) == 1:  # the usual call: one split, no per-tensor slicing
            pieces = flat.view(specs[0][1]).split([math.prod(shape) for _, _, shape in specs])
            return {name: piece.view(shape) for (name, _, shape), piece in zip(specs, pieces)}
        tensors, offset = {}, 0
        for (name, dtype, shape), size in zip(specs, sizes):
            tensors[name] = view_bytes_as(flat[offset : offset + size], dtype).view(shape)
            offset += size
        return tensors
