"""The scheduler's units of work: one sample being generated (a Sequence) and one control action,
and a finished sequence's answer in SGLang's /generate shape."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from rollfleet.wire.protocol import FinishReason, SamplingParams


@dataclass
class Sequence:
    """One sample being generated: a prompt, its sampling state and its output so far."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    return_logprob: bool
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: str = ""
    finish: FinishReason | None = None
    abort_message: str | None = None
    lora_name: str | None = None
    future: Future = field(default_factory=Future)


@dataclass
class ControlAction:
    fn: Callable[[], Any]
    needs_idle: bool
    waits_for: Callable[[Sequence], bool] | None = None  # runs only when no unfinished request matches
    future: Future = field(default_factory=Future)


def wire_result(seq: Sequence, weight_version: str) -> dict[str, Any]:
    """A finished sequence as one /generate answer (text, output_ids, meta_info)."""
    meta = {
        "id": seq.rid,
        "prompt_tokens": len(seq.prompt_ids),
        "completion_tokens": len(seq.output_ids),
        "cached_tokens": 0,
        "weight_version": weight_version,
        "finish_reason": seq.finish.to_wire(),
    }
    if seq.return_logprob:
        meta["output_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(seq.logprobs, seq.output_ids)]
    return {"text": seq.text, "output_ids": list(seq.output_ids), "meta_info": meta}
