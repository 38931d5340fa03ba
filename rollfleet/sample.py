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
    weight_version: str = ""  # of the last output token
    # SGLang's meta_info.weight_versions: [{version, start, end}] over output tokens, end exclusive;
    # two or more when weights changed while the sample was generated (an in-flight update)
    weight_versions: list[dict] = field(default_factory=list)
    engine_id: int = -1
    reward: float | None = None
    routed_experts: str | None = None  # SGLang's base64 meta_info.routed_experts, when asked (routing replay)

    @classmethod
    def from_answer(cls, prompt_index: int, sample_index: int, prompt_ids: list[int], out: dict, engine_id: int):
        """A sample from one result of an engine's /generate answer (SGLang's fields)."""
        meta = out["meta_info"]
        return cls(
            prompt_index=prompt_index,
            sample_index=sample_index,
            prompt_ids=prompt_ids,
            output_ids=list(out["output_ids"]),
            logprobs=[e[0] for e in meta.get("output_token_logprobs", [])],
            text=out.get("text", ""),
            finish_reason=meta["finish_reason"],
            weight_version=str(meta.get("weight_version", "")),
            weight_versions=list(meta.get("weight_versions", [])),
            engine_id=engine_id,
            routed_experts=meta.get("routed_experts"),
        )
