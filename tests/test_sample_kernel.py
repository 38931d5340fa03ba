"""The fused sampling kernel (engine/sequences/sample_kernel.py) against the distribution and conventions of
sampling.py's general path: greedy rows take the first argmax and the raw log_softmax, the others
draw from softmax(logits / temperature) with that logprob.

Runs where Triton runs (tests/triton_here.py).
"""

from __future__ import annotations

import torch
from triton_here import triton_device

DEVICE = triton_device()

from rollfleet.engine.sequences import sample_kernel  # noqa: E402 - after triton_device()


def _run(logits, temperature, greedy, seed=1, block=16, keys=None):
    inverse = torch.tensor([1.0 / t for t in temperature], dtype=torch.float32, device=DEVICE)
    flags = torch.tensor(greedy, dtype=torch.bool, device=DEVICE)
    keys = keys.to(DEVICE) if keys is not None else None
    return sample_kernel.fused_sample(logits.to(DEVICE), inverse, flags, seed, keys, block=block)


def test_greedy_rows_take_the_first_argmax_and_the_raw_logprob():
    torch.manual_seed(0)
    logits = torch.randn(6, 100) * 3
    logits[1, 37] = logits[1, 90] = logits[1].max() + 1  # a tie across blocks: the first one wins
    logits[2, 5] = logits[2, 6] = logits[2].max() + 1  # a tie inside a block
    tokens, logprobs = _run(logits, [0.5] * 6, [True] * 6)  # a greedy row ignores its temperature
    assert tokens.tolist() == torch.argmax(logits, dim=-1).tolist()
    assert tokens[1] == 37 and tokens[2] == 5
    want = torch.log_softmax(logits, dim=-1).gather(1, tokens.cpu()[:, None])[:, 0]
    torch.testing.assert_close(logprobs.cpu(), want, atol=1e-5, rtol=1e-5)


def test_draws_follow_softmax_over_temperature_with_its_logprob():
    base = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 3.0, -9.0, 1.5, 0.2, -0.3, 0.9, 2.5, -2.0, 0.0, 1.1, 0.4, 2.2])
    rows, temperature = 1200, 0.8
    logits = base.repeat(rows, 1)
    tokens, logprobs = _run(logits, [temperature] * rows, [False] * rows, seed=12345)
    expected = torch.softmax(base / temperature, dim=-1)
    counts = torch.bincount(tokens.cpu(), minlength=base.numel()).double()
    chi2 = (((counts - rows * expected) ** 2) / (rows * expected)).sum().item()
    assert chi2 < 45.0, f"chi-square {chi2:.1f} over {base.numel() - 1} degrees of freedom (p < 1e-4 beyond 45)"
    want = torch.log_softmax(base / temperature, dim=-1)[tokens.cpu()]
    torch.testing.assert_close(logprobs.cpu(), want, atol=1e-5, rtol=1e-5)
    again, _ = _run(logits, [temperature] * rows, [False] * rows, seed=12345)
    other, _ = _run(logits, [temperature] * rows, [False] * rows, seed=54321)
    assert torch.equal(again, tokens) and not torch.equal(other, tokens)  # the step's seed is the noise


def test_a_banned_block_and_mixed_rows():
    logits = torch.randn(4, 40)
    logits[0, :16] = float("-inf")  # a whole block banned (min_new_tokens bans stop ids the same way)
    tokens, logprobs = _run(logits, [1.0, 1.0, 0.7, 1.0], [True, False, False, True])
    assert tokens[0] >= 16 and tokens[0] == torch.argmax(logits[0])
    assert torch.isfinite(logprobs).all()
    assert tokens[3] == torch.argmax(logits[3])


def test_seeded_rows_draw_the_general_paths_token_whatever_shares_their_step():
    """A row with a sampling_seed takes the general path's noise (hashed_uniform of its step key):
    the same token as sampling.py draws, alone or beside other rows, under any step seed."""
    from rollfleet.engine.sequences.sampling import hashed_uniform, step_key

    torch.manual_seed(3)
    logits = torch.randn(6, 50) * 2
    keys = torch.tensor([step_key(1000 + row, 7) for row in range(6)])
    keys[2] = -1  # a row without a seed beside them: the step's own noise
    tokens, logprobs = _run(logits, [1.0] * 6, [False] * 6, seed=5, keys=keys)
    noise = (-torch.log(hashed_uniform(keys.clamp(min=0), 50))).clamp(min=sample_kernel.TINY).log()
    want = torch.argmax(logits - noise, dim=-1)  # sampling.py's Gumbel-max draw of seeded rows
    seeded = [0, 1, 3, 4, 5]
    assert tokens.cpu()[seeded].tolist() == want[seeded].tolist()
    alone, _ = _run(logits[:2], [1.0] * 2, [False] * 2, seed=99, keys=keys[:2])
    assert alone.tolist() == tokens[:2].tolist()
    later = torch.tensor([step_key(1000 + row, 8) for row in range(6)])  # the next position: other noise
    assert _run(logits, [1.0] * 6, [False] * 6, keys=later)[0].tolist() != tokens.tolist()
    want_lp = torch.log_softmax(logits, dim=-1).gather(1, tokens.cpu()[:, None])[:, 0]
    torch.testing.assert_close(logprobs.cpu(), want_lp, atol=1e-5, rtol=1e-5)


def test_a_plain_rows_draw_and_logprob_do_not_depend_on_what_its_neighbours_ask():
    """A step mixing plain rows with rows that ask top-k, chosen ids or a filter: the plain rows go
    through the fused kernel as in an all-plain step (the same tokens and logprob bits), the others
    through the general path as alone."""
    from rollfleet.engine.sequences.sampling import Sampler, SampleRow, seed_key
    from rollfleet.wire.protocol import SamplingParams

    def seeded(sample, **params):
        p = SamplingParams(temperature=0.9, sampling_seed=11, **params)
        return SampleRow(p, seed_key(p, sample), 3)

    logits = (torch.randn(6, 151_936, generator=torch.Generator().manual_seed(4)) * 4).to(DEVICE)
    plain = [seeded(0), SampleRow(SamplingParams(temperature=0), None, 3), seeded(1)]
    asking = [seeded(2, top_k=20), seeded(3)._replace(top_n=4)]
    asking.append(SampleRow(SamplingParams(temperature=0), None, 3, token_ids=(1, 2)))
    alone = Sampler(seed=0, fused=True).sample(logits[:3], plain)
    order = [0, 3, 1, 4, 5, 2]  # plain rows at 0, 2, 5 of the mixed step
    mixed = Sampler(seed=0, fused=True).sample(logits[order], [(plain + asking)[i] for i in order])
    general = Sampler(seed=0, fused=False).sample(logits[3:], asking)
    for at, i in zip((0, 2, 5), range(3)):
        assert (mixed.tokens[at], mixed.logprobs[at]) == (alone.tokens[i], alone.logprobs[i])  # to the bit
        assert mixed.top[at] is None and mixed.chosen[at] is None
    for at, i in zip((1, 3, 4), range(3)):
        got = (mixed.tokens[at], mixed.logprobs[at], mixed.top[at], mixed.chosen[at])
        assert got == (general.tokens[i], general.logprobs[i], general.top[i], general.chosen[i])
    assert mixed.host_bytes == alone.host_bytes + general.host_bytes
