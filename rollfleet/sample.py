"""The unit of rollout work: one generated sample and everything training needs from it.

A multi-turn episode (rollfleet.agents) is a Sample too: `output_ids` holds every token after the
prompt, the model's turns and the environment's observations in order, `loss_mask` says which are the
model's (1) and which the environment's (0), `logprobs` are the engines' for the model's tokens (0.0
for observations), and `weight_versions` spans cover the model's tokens only."""

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
    loss_mask: list[int] | None = None  # per output token: 1 the policy's, 0 an observation's (None: all 1)
    turns: int = 1  # model turns (an episode's)
    episode: dict = field(default_factory=dict)  # an episode's record: engine per turn, segments, tool seconds

    @property
    def token_versions(self) -> list[str | None]:
        """The weight version of every output token (None: an observation's, or not reported)."""
        versions: list[str | None] = [None] * len(self.output_ids)
        if not self.weight_versions:
            mask = self.loss_mask or [1] * len(self.output_ids)
            return [self.weight_version if keep else None for keep in mask]
        for span in self.weight_versions:
            versions[span["start"] : span["end"]] = [str(span["version"])] * (span["end"] - span["start"])
        return versions

    @classmethod
    def from_answer(cls, prompt_index: int, sample_index: int, prompt_ids: list[int], out: dict, engine_id: int):
        """A sample from one result of an engine's /generate answer (SGLang's fields)."""
        meta = out["meta_info"]
        return cls(
            prompt_index=prompt_index,
            sample_index=sample_index,
            prompt_ids=prompt_ids,
            output_ids=list(out["output_ids"]),
            logprobs=output_logprobs(meta),
            text=out.get("text", ""),
            finish_reason=meta["finish_reason"],
            weight_version=str(meta.get("weight_version", "")),
            weight_versions=list(meta.get("weight_versions", [])),
            engine_id=engine_id,
            routed_experts=meta.get("routed_experts"),
        )


def output_logprobs(meta: dict) -> list[float]:
    """The output tokens' logprobs of an answer's meta_info: SGLang's `output_token_logprobs` triples,
    or the embedded engine's one list (`output_token_logprob_values`, asked with return_logprob_values)."""
    values = meta.get("output_token_logprob_values")
    if values is not None:
        return list(values)
    return [entry[0] for entry in meta.get("output_token_logprobs", [])]
