"""Which sender process feeds which engine rank, and how the sender processes agree on each step.

A weight push is made by one process (`SoloFeed`: the driver, or a trainer that sends from rank 0)
or by every rank of a trainer (`RankFeed`: colocated, each rank packs into its own device's buffer
and hands handles to the engine ranks on its own GPU, so no copy crosses GPUs). Rank 0 is the
caller either way: it makes the HTTP calls, the sessions and the version; every rank gives the others
its state and its serialized handles (small strings) over a gloo group of their own, in one
all-gather per call (tensor.py), and rank 0 broadcasts the push's outcome once at its end.

Lockstep, stated once (tensor.py follows it): every rank takes part in every collective of a push,
in the same order, whatever happened locally; a rank that failed says so in its next contribution
instead of leaving, so the error reaches every rank at the same step and all of them stop there. A
rank that died makes the others' next collective fail after the group's timeout: bounded.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist


class SoloFeed:
    """One process feeds every engine rank: the collectives are the identity."""

    rank, world_size = 0, 1

    def __init__(self, facts: Mapping[str, Any] | None = None):
        self.facts = {"pid": os.getpid(), **(facts or {})}  # shown per sender in SyncReport.senders

    @property
    def is_caller(self) -> bool:
        return self.rank == 0

    def feeder(self, engine_id: int, rank_in_engine: int) -> int:
        """The sender rank whose buffer engine rank (engine_id, rank_in_engine) reads."""
        return 0

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, by rank, on every rank."""
        return [obj]

    def broadcast(self, obj: Any) -> Any:
        """The caller's `obj` on every rank."""
        return obj


class RankFeed(SoloFeed):
    """Every trainer rank feeds the engine ranks that `feeders` gives it (engine id -> sender rank
    per engine rank, rollfleet.layout.colocated_feeders); engines it does not name come from rank 0."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        feeders: Mapping[int, Sequence[int]],
        group: dist.ProcessGroup,
        facts: Mapping[str, Any] | None = None,
    ):
        super().__init__(facts)
        self.rank, self.world_size, self.group = rank, world_size, group
        self.feeders = {engine_id: tuple(ranks) for engine_id, ranks in feeders.items()}

    @classmethod
    def new_group(cls, timeout_s: float) -> dist.ProcessGroup:
        """A gloo group of every rank of the default group, for the handles and the decisions (small
        objects; the default group may be NCCL). Collective: every rank calls it together."""
        return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))

    def feeder(self, engine_id: int, rank_in_engine: int) -> int:
        ranks = self.feeders.get(engine_id)
        return ranks[rank_in_engine] if ranks is not None and rank_in_engine < len(ranks) else 0

    def all_gather(self, obj: Any) -> list[Any]:
        if self.world_size == 1:  # as SoloFeed: a gloo collective of one rank still pickled, ~0.3 ms a call
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast(self, obj: Any) -> Any:
        if self.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]
