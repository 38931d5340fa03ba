"""The batched device sampler (unit level): filters keep exactly what SGLang keeps, draws follow the
kept distribution, seeds give the same tokens whatever shares the batch, logprobs follow SGLang
0.5.23's convention, and only kilobytes leave the device."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollfleet.engine.sequences.sampling import Sampler, SampleRow, _filter, hashed_uniform, seed_key
from rollfleet.wire.protocol import SamplingParams

LOGITS = torch.log(torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03]))


def row(position: int = 0, sample: int = 0, **params) -> SampleRow:
    p = SamplingParams(**params)
    return SampleRow(p, seed_key(p, sample), position)


def kept(**params) -> list[int]:
    masked = _filter(LOGITS[None, :].clone(), [SamplingParams(**params)])
    return [i for i, value in enumerate(masked[0].tolist()) if value > -math.inf]


def test_top_k_keeps_the_k_most_likely():
    assert kept(top_k=2) == [0, 1]
    assert kept(top_k=-1) == [0, 1, 2, 3, 4]


def test_top_p_keeps_the_smallest_set_reaching_p():
    assert kept(top_p=0.5) == [0]
    assert kept(top_p=0.6) == [0, 1]
    assert kept(top_p=0.9) == [0, 1, 2]


def test_min_p_drops_tokens_below_a_fraction_of_the_best():
    assert kept(min_p=0.2) == [0, 1, 2]  # 0.2 * 0.5 = 0.1


def test_filters_apply_together_and_per_row():
    assert kept(top_k=3, top_p=0.6, min_p=0.2) == [0, 1]
    masked = _filter(LOGITS.repeat(3, 1), [SamplingParams(top_k=1), SamplingParams(), SamplingParams(min_p=0.2)])
    assert [[i for i, v in enumerate(r) if v > -math.inf] for r in masked.tolist()] == [[0], [0, 1, 2, 3, 4], [0, 1, 2]]


def test_temperature_zero_is_the_exact_argmax_of_the_raw_logits():
    logits = torch.randn(6, 1000, generator=torch.Generator().manual_seed(0))
    out = Sampler().sample(logits, [row(temperature=0) for _ in range(6)])
    assert out.tokens == logits.argmax(-1).tolist()
    want = torch.log_softmax(logits, -1).gather(1, logits.argmax(-1, keepdim=True))[:, 0].tolist()
    assert out.logprobs == pytest.approx(want, abs=1e-6)  # the raw logits' (the sampler takes the chosen one alone)


def test_logprobs_are_after_temperature_before_filters_as_sglang_returns_them():
    logits = LOGITS.repeat(3, 1)
    rows = [row(temperature=0.5, sampling_seed=1), row(temperature=0.5, top_k=2, sampling_seed=1), row(temperature=0)]
    rows = [
        SampleRow(r.params, r.key, 0, top_n=3 if i == 1 else 0, token_ids=(4, 0) if i == 2 else None)
        for i, r in enumerate(rows)
    ]
    out = Sampler().sample(logits, rows)
    scaled = torch.log_softmax(LOGITS / 0.5, -1)
    assert math.isclose(out.logprobs[0], float(scaled[out.tokens[0]]), rel_tol=1e-6)
    assert math.isclose(out.logprobs[1], float(scaled[out.tokens[1]]), rel_tol=1e-6)  # top-k does not renormalise
    assert [t for _, t in out.top[1]] == [0, 1, 2] and math.isclose(out.top[1][0][0], float(scaled[0]), rel_tol=1e-6)
    raw = torch.log_softmax(LOGITS, -1)
    assert out.chosen[2] == [(float(raw[4]), 4), (float(raw[0]), 0)] and out.top[0] is None and out.chosen[0] is None


@pytest.mark.parametrize("temperature", [0.0, 1.0, 0.7])
def test_a_rows_logprob_has_the_same_bits_whatever_its_neighbours_ask(temperature):
    logits = torch.randn(3, 151_936, generator=torch.Generator().manual_seed(3)) * 4
    params = SamplingParams(temperature=temperature, sampling_seed=5)
    mine = SampleRow(params, seed_key(params, 0), 0)
    alone = Sampler().sample(logits[:1], [mine])
    asking = [SampleRow(params, None, 0, top_n=5), SampleRow(params, None, 0, token_ids=(1, 2))]
    beside = Sampler().sample(logits, [mine, *asking])
    assert beside.tokens[0] == alone.tokens[0] and beside.logprobs[0] == alone.logprobs[0]  # to the bit
    # a row that asks the full distribution gets its token's logprob from it, as its top entries
    top = SampleRow(SamplingParams(temperature=0), None, 0, top_n=1)
    out = Sampler().sample(logits, [top, *asking])
    assert out.top[0][0] == (out.logprobs[0], out.tokens[0])


def test_min_new_tokens_bans_the_stop_ids_before_logprobs():
    logits = torch.tensor([[10.0, 0.0, 0.0]])
    p = SamplingParams(temperature=0, min_new_tokens=2)
    out = Sampler().sample(logits, [SampleRow(p, None, 0, banned=frozenset({0}), token_ids=(0,))])
    assert out.tokens != [0] and out.chosen[0][0][0] == torch.finfo(torch.float32).min  # -inf, clamped
    assert math.isclose(out.logprobs[0], math.log(0.5), rel_tol=1e-6)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(-(2**63), 2**63 - 1), index=st.integers(0, 7), mates=st.integers(0, 5), at=st.integers(0, 5))
def test_a_seeded_sample_draws_the_same_tokens_whatever_shares_its_batch(seed, index, mates, at):
    logits = torch.randn(1, 300, generator=torch.Generator().manual_seed(index))
    mine = [row(position, index, sampling_seed=seed, top_p=0.9) for position in range(6)]
    alone = [Sampler().sample(logits, [r]).tokens[0] for r in mine]
    others = torch.randn(mates, 300)
    in_batch = []
    for r in mine:
        batch = torch.cat([others[:at], logits, others[at:]])
        rows = [row(sampling_seed=7 * i + 1) if i % 2 else row() for i in range(mates)]
        rows.insert(min(at, mates), r)
        in_batch.append(Sampler().sample(batch, rows).tokens[min(at, mates)])
    assert alone == in_batch


def test_seeds_differ_by_sample_and_by_position():
    logits = torch.zeros(1, 1000)
    draws = {
        (s, p): Sampler().sample(logits, [row(p, s, sampling_seed=5)]).tokens[0] for s in range(4) for p in range(4)
    }
    assert len(set(draws.values())) > 12  # 16 draws of 1000 equally likely tokens: nearly all distinct


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


CHI2_4DOF_P1E6 = 32.0  # P(chi2 with 4 degrees of freedom > 32) is below 2e-6


def test_seeded_draws_follow_the_temperature_scaled_distribution():
    draws = 20_000
    logits = LOGITS.repeat(draws, 1)
    rows = [row(position, sampling_seed=123, temperature=0.7) for position in range(draws)]
    tokens = torch.tensor(Sampler().sample(logits, rows).tokens)
    counts = torch.bincount(tokens, minlength=5).double()
    assert chi_square(counts, torch.softmax(LOGITS.double() / 0.7, -1)) < CHI2_4DOF_P1E6


def test_unseeded_draws_follow_the_kept_distribution():
    draws = 20_000
    logits = LOGITS.repeat(draws, 1)
    tokens = torch.tensor(Sampler(seed=7).sample(logits, [row(top_k=3)] * draws).tokens)
    counts = torch.bincount(tokens, minlength=5).double()
    assert counts[3:].sum() == 0
    kept_probs = torch.softmax(LOGITS[:3].double(), -1)
    expected = kept_probs * draws
    assert float(((counts[:3] - expected) ** 2 / expected).sum()) < 28.0  # 2 dof, p < 1e-6


def test_hashed_uniforms_are_uniform_and_depend_only_on_key_and_token():
    keys = torch.tensor([1, 2, 3], dtype=torch.int64)
    u = hashed_uniform(keys, 50_000)
    assert bool((u > 0).all() and (u < 1).all())
    assert torch.equal(hashed_uniform(keys[1:2], 50_000)[0], u[1])
    counts = torch.histc(u[0], bins=10, min=0, max=1).double()
    assert chi_square(counts, torch.full((10,), 0.1, dtype=torch.double)) < 45.0  # 9 dof, p < 1e-6


def test_only_the_sampled_ids_and_asked_logprobs_leave_the_device():
    rows, vocab = 64, 4096
    logits = torch.randn(rows, vocab)
    plain = Sampler().sample(logits, [row() for _ in range(rows)])
    assert plain.host_bytes == rows * (8 + 4)  # an int64 id and a float32 logprob per row
    asked = [
        SampleRow(SamplingParams(), None, 0, top_n=5 if i == 0 else 0, token_ids=(1, 2) if i == 1 else None)
        for i in range(rows)
    ]
    out = Sampler().sample(logits, asked)
    assert out.host_bytes == rows * 12 + 5 * (4 + 8) + 2 * 4
    assert out.host_bytes < vocab * 4  # less than one row of float32 logits for the whole batch


def test_the_fused_kernel_s_row_facts_are_kept_while_the_rows_params_are_the_same_objects():
    """`Sampler._known` (the fused kernel's inverse temperatures and greedy flags, made once for a
    steady decode's rows): kept while each row has the same params object as last step; made again
    when a row's params change, a row leaves, or the vocabulary does."""
    warm, cold, topk = SamplingParams(temperature=0.5), SamplingParams(temperature=0.0), SamplingParams(top_k=3)
    rows = [SampleRow(warm, None, 0), SampleRow(cold, None, 0), SampleRow(topk, None, 0)]
    sampler, cpu = Sampler(), torch.device("cpu")
    first = sampler._known(rows, 10, cpu)
    assert first.plain == [True, True, False]
    assert first.inverse.tolist() == [2.0, 1.0, 1.0] and first.greedy.tolist() == [False, True, False]
    later = [SampleRow(p, None, 5) for p in (warm, cold, topk)]  # the next step: new rows, the same params
    assert sampler._known(later, 10, cpu) is first
    assert sampler._known(later, 3, cpu) is not first  # top_k 3 of a 3-token vocabulary keeps everything
    assert sampler._known(later, 3, cpu).plain == [True, True, True]
    hotter = [SampleRow(SamplingParams(temperature=2.0), None, 6), *later[1:]]
    assert sampler._known(hotter, 3, cpu).inverse.tolist() == [0.5, 1.0, 1.0]
    assert sampler._known(later[:2], 3, cpu).inverse.tolist() == [2.0, 1.0]
