"""The tp ranks of one engine, seen from one of them: gather a value from every rank, and the one
rule for changes: every rank agrees or none applies."""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist


class Ranks:
    def __init__(self, group: dist.ProcessGroup | None):
        self.group = group  # gloo group of this engine's ranks (None when tp_size == 1)

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group) if self.group is not None else 0

    @property
    def size(self) -> int:
        return dist.get_world_size(self.group) if self.group is not None else 1

    def gather(self, value) -> list:
        """`value` of every rank, in rank order (a collective: every rank calls it)."""
        if self.group is None:
            return [value]
        out = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(out, value, group=self.group)
        return out

    def agree(
        self, refusal: str | None, error: type[ValueError], explain: Callable[[list[str]], str] | None = None
    ) -> None:
        """Every rank passes its refusal (None: ready to apply). When any rank refused, every rank
        raises `error` with the refusals (deduplicated, joined, or as `explain` words them), so none
        applies; otherwise every rank goes on and applies."""
        refusals = sorted({r for r in self.gather(refusal) if r})
        if refusals:
            raise error(explain(refusals) if explain is not None else "; ".join(refusals))
