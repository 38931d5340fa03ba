"""Where each rollout GPU sits: one `Layout` (engines, tp, pp, ep), validated once, and what derives from it.

The rollout world is dp x pp x tp GPUs, tp fastest, then pp, then dp:

    tp_rank = r % tp      pp_rank = (r // tp) % pp      dp_rank = r // (tp * pp)

so the GPUs of one engine (one dp replica) are the contiguous ranks
[dp_rank * tp * pp, (dp_rank + 1) * tp * pp).

Expert parallel lives inside an engine's TP group, as in SGLang: with m = tp // ep,
the TP group splits into m expert groups of ep ranks each, taking every m-th tp rank
(tp=4, ep=2: expert groups {0, 2} and {1, 3}). A rank's place in its expert group,
`ep_rank = tp_rank // m`, says which 1/ep of the experts it holds. ep == tp gives
ep_rank == tp_rank; ep == 1 gives ep_rank == 0.

Weight-update group (nccl sync): the sender is rank 0, the k-th targeted engine's ranks start at
1 + the ranks of the engines before it (`weight_update_group`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

_EXPERT_COUNT_NAMES = ("num_experts", "num_local_experts", "n_routed_experts")


@dataclass(frozen=True)
class LayoutProblem:
    """One reason a layout cannot run: the field, its value, what is wrong and the fix."""

    field: str
    value: int
    problem: str
    fix: str

    def __str__(self) -> str:
        return f"{self.field}={self.value}: {self.problem} (fix: {self.fix})"


class LayoutError(ValueError):
    def __init__(self, problems: list[LayoutProblem]):
        self.problems = problems
        lines = [str(p) for p in problems]
        title = "invalid rollout layout"
        super().__init__(
            f"{title}: {lines[0]}" if len(lines) == 1 else title + ":\n" + "\n".join(f"  {x}" for x in lines)
        )


@dataclass(frozen=True)
class RankInfo:
    """Coordinates of one rollout rank (one GPU) in the dp x pp x tp grid, plus its expert shard."""

    rank: int
    world_size: int
    dp_rank: int
    dp_size: int
    pp_rank: int
    pp_size: int
    tp_rank: int
    tp_size: int
    ep_rank: int
    ep_size: int

    @property
    def engine_id(self) -> int:
        return self.dp_rank

    @property
    def is_engine_head(self) -> bool:
        """The rank that owns the engine server; the engine's other ranks are shells."""
        return self.tp_rank == 0 and self.pp_rank == 0

    @property
    def rank_in_engine(self) -> int:
        return self.pp_rank * self.tp_size + self.tp_rank


@dataclass(frozen=True)
class Layout:
    """The rollout fleet's shape; constructing one validates it (LayoutError names field, value, fix)."""

    num_engines: int
    tp_size: int = 1
    pp_size: int = 1
    ep_size: int = 1

    def __post_init__(self):
        sizes = {"num_engines": self.num_engines, "tp_size": self.tp_size, "pp_size": self.pp_size}
        problems = [
            LayoutProblem(name, value, "must be >= 1", f"set {name} >= 1") for name, value in sizes.items() if value < 1
        ]
        if self.ep_size < 1 or (self.tp_size >= 1 and self.tp_size % self.ep_size):
            problems.append(
                LayoutProblem(
                    "ep_size",
                    self.ep_size,
                    f"must divide tp_size={self.tp_size} (expert groups split the engine's TP group)",
                    f"set ep_size to one of {divisors(max(self.tp_size, 1))}",
                )
            )
        if problems:
            raise LayoutError(problems)

    @property
    def gpus_per_engine(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def world_size(self) -> int:
        """All rollout ranks (one per GPU)."""
        return self.num_engines * self.gpus_per_engine

    def ranks(self) -> list[RankInfo]:
        """RankInfo for every rank of the rollout world, ordered by rank."""
        return [self._rank_info(rank) for rank in range(self.world_size)]

    def _rank_info(self, rank: int) -> RankInfo:
        tp, pp = self.tp_size, self.pp_size
        return RankInfo(
            rank=rank,
            world_size=self.world_size,
            dp_rank=rank // (tp * pp),
            dp_size=self.num_engines,
            pp_rank=(rank // tp) % pp,
            pp_size=pp,
            tp_rank=rank % tp,
            tp_size=tp,
            ep_rank=(rank % tp) // (tp // self.ep_size),
            ep_size=self.ep_size,
        )

    def check_model(self, model_config: Any, *, allow_kv_head_replication: bool = False) -> None:
        """Raise LayoutError if the model cannot split this way: heads by tp, experts by ep, layers over
        pp. SGLang replicates KV heads when tp is a multiple of their count (`allow_kv_head_replication`).
        `model_config` is a transformers PretrainedConfig or its dict."""
        config = _text_config(model_config)
        problems = _head_problems(config, self.tp_size, allow_kv_head_replication)
        experts = _expert_count(config)
        if self.ep_size > 1 and not experts:
            problems.append(
                LayoutProblem("ep_size", self.ep_size, "the model has no experts", "set ep_size=1 for a dense model")
            )
        elif experts and experts % self.ep_size:
            problems.append(_split_problem("number of experts", experts, "ep_size", self.ep_size))
        layers = _get(config, "num_hidden_layers")
        if layers and layers < self.pp_size:
            problems.append(
                LayoutProblem(
                    "pp_size",
                    self.pp_size,
                    f"more pipeline stages than the model's num_hidden_layers={layers}",
                    f"set pp_size <= {layers}",
                )
            )
        if problems:
            raise LayoutError(problems)


def engine_rank_groups(rank_infos: Sequence[RankInfo]) -> dict[int, list[RankInfo]]:
    """Engine id -> that engine's ranks ordered by rank_in_engine (the head first)."""
    groups: dict[int, list[RankInfo]] = {}
    for info in sorted(rank_infos, key=lambda i: (i.engine_id, i.rank_in_engine)):
        groups.setdefault(info.engine_id, []).append(info)
    return groups


def colocated_feeders(layout: Layout, trainer_world_size: int) -> dict[int, tuple[int, ...]]:
    """Engine id -> the trainer rank on each of its ranks' GPUs (by rank_in_engine), colocated.

    The one statement of the colocated placement: rollout rank r sits in placement-group bundle r
    (fleet/placement.py) and trainer rank t in bundle t (train/worker.py TrainerGroup), so trainer
    rank r shares rollout rank r's GPU. The tensor transport hands each engine rank handles to the
    buffer of that trainer rank, so every copy stays on one GPU."""
    if trainer_world_size != layout.world_size:
        raise ValueError(
            f"trainer.world_size={trainer_world_size}: colocated trainer ranks must match the rollout world "
            f"num_engines*tp_size*pp_size={layout.world_size} one to one (one of each per GPU); "
            f"set trainer.world_size={layout.world_size}"
        )
    return {
        engine_id: tuple(info.rank for info in infos) for engine_id, infos in engine_rank_groups(layout.ranks()).items()
    }


def weight_update_group(ranks_per_engine: Sequence[int]) -> tuple[list[int], int]:
    """(each engine's first rank, world size) of a weight-update group of the sender (rank 0) and the
    given engines in order, each with its tp*pp ranks: engine k starts at 1 + the ranks before it."""
    offsets, next_rank = [], 1
    for ranks in ranks_per_engine:
        offsets.append(next_rank)
        next_rank += ranks
    return offsets, next_rank


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _head_problems(config: Any, tp_size: int, allow_kv_head_replication: bool) -> list[LayoutProblem]:
    problems = []
    heads = _get(config, "num_attention_heads")
    kv_heads = _get(config, "num_key_value_heads") or heads
    if heads and heads % tp_size:
        problems.append(_split_problem("num_attention_heads", heads, "tp_size", tp_size))
    replicated = allow_kv_head_replication and kv_heads and tp_size % kv_heads == 0
    if kv_heads and kv_heads % tp_size and not replicated:
        problems.append(_split_problem("num_key_value_heads", kv_heads, "tp_size", tp_size))
    return problems


def _expert_count(config: Any) -> int | None:
    """Routed experts per MoE layer (Qwen3-MoE: num_experts, Mixtral: num_local_experts, DeepSeek: n_routed_experts)."""
    counts = [_get(config, name) for name in _EXPERT_COUNT_NAMES]
    return next((count for count in counts if count), None)


def _split_problem(model_field: str, count: int, size_name: str, size: int) -> LayoutProblem:
    return LayoutProblem(
        size_name,
        size,
        f"the model's {model_field}={count} is not divisible by it",
        f"set {size_name} to one of {divisors(count)}",
    )


def _text_config(config: Any) -> Any:
    """The language-model part of a config (multimodal configs nest it as text_config)."""
    if isinstance(config, Mapping):
        return config.get("text_config") or config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _get(config: Any, name: str) -> Any:
    return config.get(name) if isinstance(config, Mapping) else getattr(config, name, None)
