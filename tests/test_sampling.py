"""Sampling filters (unit level): each filter removes exactly the tokens it should."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollfleet.engine.sampling import filtered_probs, make_generator, sample_token
from rollfleet.wire.protocol import SamplingParams

LOGITS = torch.log(torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03]))


def kept(**params) -> list[int]:
    probs = filtered_probs(LOGITS, SamplingParams(**params))
    assert abs(float(probs.sum()) - 1) < 1e-6
    return [i for i, p in enumerate(probs.tolist()) if p > 0]


def test_top_k_keeps_the_k_most_likely():
    assert kept(top_k=2) == [0, 1]
    assert kept(top_k=-1) == [0, 1, 2, 3, 4]


def test_top_p_keeps_the_smallest_set_reaching_p():
    assert kept(top_p=0.5) == [0]
    assert kept(top_p=0.6) == [0, 1]
    assert kept(top_p=0.9) == [0, 1, 2]


def test_min_p_drops_tokens_below_a_fraction_of_the_best():
    assert kept(min_p=0.2) == [0, 1, 2]  # 0.2 * 0.5 = 0.1


def test_temperature_zero_is_argmax():
    assert sample_token(LOGITS, SamplingParams(temperature=0), make_generator(SamplingParams(), 0)) == 0


@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 2**31), index=st.integers(0, 7))
def test_same_seed_same_draws(seed, index):
    params = SamplingParams(sampling_seed=seed)
    draws = [
        [sample_token(LOGITS, params, g) for _ in range(8)]
        for g in (make_generator(params, index), make_generator(params, index))
    ]
    assert draws[0] == draws[1]
