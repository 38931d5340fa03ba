"""Where each rollout GPU sits: rank coordinates, engine groups, and layout validation.

The rollout world is dp x pp x tp GPUs, tp fastest, then pp, then dp:

    tp_rank = r % tp      pp_rank = (r // tp) % pp      dp_rank = r // (tp * pp)

so the GPUs of one engine (one dp replica) are the contiguous ranks
[dp_rank * tp * pp, (dp_rank + 1) * tp * pp).

Expert parallel lives inside an engine's TP group, as in SGLang: with m = tp // ep,
the TP group splits into m expert groups of ep ranks each, taking every m-th tp rank
(tp=4, ep=2: expert groups {0, 2} and {1, 3}). A rank's place in its expert group,
`ep_rank = tp_rank // m`, says which 1/ep of the experts it holds. ep == tp gives
ep_rank == tp_rank; ep == 1 gives ep_rank == 0.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

_EXPERT_COUNT_NAMES = ("num_experts", "num_local_experts", "n_routed_experts")


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


def build_rank_infos(dp_size: int, pp_size: int, tp_size: int, ep_size: int = 1) -> list[RankInfo]:
    """RankInfo for every rank of the rollout world, ordered by rank."""
    world_size = dp_size * pp_size * tp_size
    problems = _size_problems(world_size, tp_size, pp_size, ep_size, dp_size=dp_size)
    if problems:
        raise ValueError(_join("invalid rollout layout", problems))
    return [_rank_info(rank, dp_size, pp_size, tp_size, ep_size) for rank in range(world_size)]


def _rank_info(rank: int, dp_size: int, pp_size: int, tp_size: int, ep_size: int) -> RankInfo:
    tp_rank = rank % tp_size
    return RankInfo(
        rank=rank,
        world_size=dp_size * pp_size * tp_size,
        dp_rank=rank // (tp_size * pp_size),
        dp_size=dp_size,
        pp_rank=(rank // tp_size) % pp_size,
        pp_size=pp_size,
        tp_rank=tp_rank,
        tp_size=tp_size,
        ep_rank=tp_rank // (tp_size // ep_size),
        ep_size=ep_size,
    )


def engine_rank_groups(rank_infos: list[RankInfo]) -> dict[int, list[RankInfo]]:
    """Engine id -> that engine's ranks ordered by rank_in_engine (the head first)."""
    groups: dict[int, list[RankInfo]] = {}
    for info in sorted(rank_infos, key=lambda i: (i.engine_id, i.rank_in_engine)):
        groups.setdefault(info.engine_id, []).append(info)
    return groups


def weight_update_rank_offset(engine_id: int, tp_size: int, pp_size: int) -> int:
    """Rank of an engine's first GPU in the weight-update group (trainer rank 0 is rank 0)."""
    return 1 + engine_id * tp_size * pp_size


def weight_update_world_size(num_engines: int, tp_size: int, pp_size: int) -> int:
    """Size of the weight-update group: trainer rank 0 plus every engine rank."""
    return 1 + num_engines * tp_size * pp_size


def validate_layout(
    world_size: int,
    tp_size: int,
    pp_size: int,
    ep_size: int,
    model_config: Any = None,
    train_sequence_parallel_size: int = 1,
    colocated: bool = False,
    *,
    allow_kv_head_replication: bool = False,
) -> None:
    """Raise ValueError, naming each field, its value and the fix, if this layout cannot run.

    `model_config` is a transformers PretrainedConfig or its dict; when given, the model
    must split: heads by tp, experts by ep, layers over pp. SGLang replicates KV heads
    when tp is a multiple of their count; pass `allow_kv_head_replication=True` to accept that.
    """
    problems = _size_problems(world_size, tp_size, pp_size, ep_size)
    if not problems and model_config is not None:
        problems += _model_problems(_text_config(model_config), tp_size, pp_size, ep_size, allow_kv_head_replication)
    if colocated and train_sequence_parallel_size > 1 and tp_size * pp_size > 1:
        problems.append(
            f"train sequence_parallel_size={train_sequence_parallel_size} cannot combine with rollout "
            f"tp_size*pp_size={tp_size * pp_size} on the same (colocated) workers "
            "(fix: set sequence_parallel_size=1, or tp_size=pp_size=1, or use disaggregated placement)"
        )
    if problems:
        raise ValueError(_join("invalid rollout layout", problems))


def _size_problems(world_size: int, tp_size: int, pp_size: int, ep_size: int, **extra: int) -> list[str]:
    sizes = {"world_size": world_size, "tp_size": tp_size, "pp_size": pp_size, "ep_size": ep_size, **extra}
    problems = [f"{name}={value}: must be >= 1 (fix: set {name} >= 1)" for name, value in sizes.items() if value < 1]
    if problems:
        return problems
    engine_size = tp_size * pp_size
    if world_size % engine_size:
        problems.append(
            f"world_size={world_size}: not divisible by tp_size*pp_size={engine_size} "
            f"(fix: use a multiple of {engine_size} GPUs, or tp_size*pp_size among {_divisors(world_size)})"
        )
    if tp_size % ep_size:
        problems.append(
            f"ep_size={ep_size}: must divide tp_size={tp_size} (fix: set ep_size to one of {_divisors(tp_size)})"
        )
    return problems


def _model_problems(
    config: Any, tp_size: int, pp_size: int, ep_size: int, allow_kv_head_replication: bool
) -> list[str]:
    problems = _head_problems(config, tp_size, allow_kv_head_replication)
    experts = _expert_count(config)
    if ep_size > 1 and not experts:
        problems.append(f"ep_size={ep_size}: the model has no experts (fix: set ep_size=1 for a dense model)")
    elif experts and experts % ep_size:
        problems.append(_split_problem("number of experts", experts, "ep_size", ep_size))
    layers = _get(config, "num_hidden_layers")
    if layers and layers < pp_size:
        problems.append(
            f"pp_size={pp_size}: more pipeline stages than the model's num_hidden_layers={layers} "
            f"(fix: set pp_size <= {layers})"
        )
    return problems


def _head_problems(config: Any, tp_size: int, allow_kv_head_replication: bool) -> list[str]:
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


def _split_problem(model_field: str, count: int, size_name: str, size: int) -> str:
    return (
        f"{size_name}={size}: the model's {model_field}={count} is not divisible by it "
        f"(fix: set {size_name} to one of {_divisors(count)})"
    )


def _text_config(config: Any) -> Any:
    """The language-model part of a config (multimodal configs nest it as text_config)."""
    if isinstance(config, Mapping):
        return config.get("text_config") or config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _get(config: Any, name: str) -> Any:
    return config.get(name) if isinstance(config, Mapping) else getattr(config, name, None)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _join(title: str, problems: list[str]) -> str:
    return f"{title}: {problems[0]}" if len(problems) == 1 else title + ":\n" + "\n".join(f"  {p}" for p in problems)
