"""The unit of rollout work: one generated sample and everything training needs from it."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Sample:
    prompt_index: int
    sample_index: int  # 0..n-1 within its prompt's group
    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: str = ""
    finish_reason: dict = field(default_factory=dict)
    weight_version: str = ""
    engine_id: int = -1
    reward: float | None = None
