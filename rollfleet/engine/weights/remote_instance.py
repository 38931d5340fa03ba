"""R-Fork on one tp rank (rollfleet.wire.remote_instance has the protocol): the seed's send and the
destination's receive of every parameter of this rank's shard, in `model.named_parameters()` order,
on a group of two (this rank and the peer engine's rank of the same tp index).

Every method is a lockstep action: each rank acts on its own group, then the ranks agree
(`Ranks.agree`), so the engine answers once for all of them. A group lives from its join to the end
of the one send or receive it serves; a failed join, send or receive destroys it. Every wait is
bounded by the group's timeout (the join's `timeout_s`).
"""

from __future__ import annotations

import logging
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from rollfleet.engine.lora.lora_merge import LoraMerge
from rollfleet.engine.tp.payloads import first_line
from rollfleet.engine.tp.ranks import Ranks
from rollfleet.engine.tp.shards import local_of
from rollfleet.engine.weights.load_prints import LoadPrints
from rollfleet.engine.weights.weight_groups import WeightUpdateError
from rollfleet.engine.weights.weight_update import WeightUpdater
from rollfleet.wire.buckets import dtype_name
from rollfleet.wire.group import join_weight_update_group, wait_for_store
from rollfleet.wire.remote_instance import parse_ports, rank_group_name

log = logging.getLogger("rollfleet.engine")


class RemoteInstanceError(WeightUpdateError):
    """An R-Fork join, send or receive failed on some rank; its groups are gone (HTTP 400)."""


class RemoteInstance:
    def __init__(self, model: nn.Module, lora: LoraMerge, weights: WeightUpdater, prints: LoadPrints, ranks: Ranks):
        self.model, self.lora, self.weights, self.prints, self.ranks = model, lora, weights, prints, ranks
        self.groups: dict[str, dist.ProcessGroup] = {}  # this rank's group name -> group

    def layout(self) -> list[list]:
        """[name, full shape, dtype] of every parameter, in broadcast order: equal on seed and
        destination exactly when their broadcasts line up (with equal tp and ep sizes)."""
        return [[name, list(p.shape), dtype_name(p.dtype)] for name, p in self.model.named_parameters()]

    def _shards(self) -> list[torch.Tensor]:
        """This rank's storage of every parameter, in broadcast order, holding base weights (an
        adapter merged for a batch is restored first; it merges again on the next batch that asks)."""
        self.lora.base_params()
        return [local_of(p) for _, p in self.model.named_parameters()]

    def _name(self, ports: str, group_name: str) -> tuple[str, int]:
        port = parse_ports(ports)[self.ranks.rank]
        return rank_group_name(group_name, port, self.ranks.rank), port

    def join(
        self, master_address: str, ports: str, group_rank: int, group_name: str, backend: str, timeout_s: float
    ) -> None:
        """Join this rank's group (the seed as group rank 0 serves its store), on every rank or none."""
        name, port = self._name(ports, group_name)
        where = f"tp rank {self.ranks.rank}: group {name!r} at tcp://{master_address}:{port} as group rank {group_rank}"
        refusal, created = None, False
        if name in self.groups:
            refusal = f"{where}: already joined (one transfer per group name at a time)"
        elif self.weights.released():
            refusal = "weights are released: call /resume_memory_occupation with tags ['weights'] first"
        else:
            if backend == "nccl" and local_of(next(self.model.parameters())).device.type == "cpu":
                backend = "gloo"  # a CPU engine's peer uses gloo too (both sides decide alike)
            try:
                if group_rank != 0:  # the seed's store may start a little after this join
                    wait_for_store(master_address, port, timedelta(seconds=timeout_s))
                group = join_weight_update_group(
                    master_address, port, group_rank, 2, name, backend, timedelta(seconds=timeout_s)
                )
                self.groups[name], created = group, True
                dist.barrier(group=group)  # SGLang's seed and destination both end their join with one
            except (RuntimeError, ValueError) as exc:  # DistStoreError / DistNetworkError on timeout
                refusal = f"{where}: not joined within {timeout_s:g} s: {first_line(exc)}"
        try:
            self.ranks.agree(refusal, RemoteInstanceError)
        except RemoteInstanceError:
            if created:
                dist.destroy_process_group(self.groups.pop(name))
            raise

    def send(self, ports: str, group_name: str) -> int:
        """The seed: broadcast every parameter of this rank's shard; the group is destroyed after.
        The bytes sent by this rank."""
        shards = self._shards()
        self._transfer(ports, group_name, shards, "sending to")
        return sum(t.numel() * t.element_size() for t in shards)

    def receive(self, ports: str, group_name: str) -> list[str]:
        """The destination: receive every parameter of this rank's shard in place. The weights are
        'not loaded' from the first byte until every rank received everything."""
        shards = self._shards()
        self.weights.forget_loaded()
        self.prints.forget()  # fingerprints taken of the old values
        self._transfer(ports, group_name, shards, "receiving from")
        self.weights.mark_loaded()
        return sorted(self.weights.schema.required_names)

    def destroy(self, ports: str, group_name: str) -> None:
        """Drop this rank's group if it exists (a join whose transfer never came)."""
        name, _ = self._name(ports, group_name)
        group = self.groups.pop(name, None)
        if group is not None:
            dist.destroy_process_group(group)

    def _transfer(self, ports: str, group_name: str, shards: list[torch.Tensor], verb: str) -> None:
        name, _ = self._name(ports, group_name)
        group, refusal = self.groups.pop(name, None), None
        if group is None:
            refusal = (
                f"tp rank {self.ranks.rank}: no group {name!r} on this engine (have {sorted(self.groups)}): "
                "call /init_weights_send_group_for_remote_instance first"
            )
        else:
            try:
                for shard in shards:
                    dist.broadcast(shard, group=group, group_src=0)
                if shards and shards[0].device.type == "cuda":
                    torch.cuda.synchronize(shards[0].device)
            except RuntimeError as exc:  # the peer died or stopped past the group's timeout
                refusal = f"tp rank {self.ranks.rank}: {verb} the peer on group {name!r} failed: {first_line(exc)}"
            finally:
                dist.destroy_process_group(group)
        self.ranks.agree(refusal, RemoteInstanceError)
