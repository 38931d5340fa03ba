"""Token sampling for one decode step: temperature, top-k, top-p, min-p, per-sample seeds.

Each sample owns a `torch.Generator`, so a seeded sample draws the same tokens whatever
else shares its batch (same seed + same weights = same tokens).
"""

from __future__ import annotations

import torch

from rollfleet.wire.protocol import SamplingParams


def make_generator(params: SamplingParams, sample_index: int) -> torch.Generator:
    generator = torch.Generator()
    if params.sampling_seed is None:
        generator.seed()
    else:
        # manual_seed takes [-2**63, 2**64): fold the whole of SGLang's seed range (and the index) into it
        generator.manual_seed((params.sampling_seed * 1_000_003 + sample_index) % 2**64)
    return generator


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities of one row after temperature, top-k, top-p and min-p."""
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    if params.top_k > 0 and params.top_k < probs.numel():
        kth = torch.topk(probs, params.top_k).values[-1]
        probs = torch.where(probs < kth, torch.zeros_like(probs), probs)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # keep a token if the mass before it is below top_p (the first token always stays)
        drop_sorted = (torch.cumsum(sorted_probs, dim=-1) - sorted_probs) >= params.top_p
        probs = probs.scatter(0, order[drop_sorted], 0.0)
    if params.min_p > 0.0:
        probs = torch.where(probs < params.min_p * probs.max(), torch.zeros_like(probs), probs)
    return probs / probs.sum()


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    if params.is_greedy:
        return int(torch.argmax(logits))
    probs = filtered_probs(logits, params)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))
