"""GRPO math: advantages, the clipped loss, normalisation, k3 KL, truncated importance sampling, mismatch."""

from __future__ import annotations

import math

import pytest
import torch

from rollfleet.train.grpo import (
    aggregate,
    group_advantages,
    kl_k3,
    logprob_mismatch,
    policy_loss,
    truncated_is_weights,
)


def test_advantages_are_centred_per_group_and_scaled_by_std():
    rewards = [1.0, 0.0, 0.0, 1.0, 0.2, 0.4, 0.6, 0.8, 0.5, 0.5, 0.5, 0.5]
    adv = group_advantages(rewards, group_size=4)
    groups = adv.view(3, 4)
    assert torch.allclose(groups.sum(dim=1), torch.zeros(3), atol=1e-5)
    assert torch.allclose(groups[:2].std(dim=1), torch.ones(2), atol=1e-4)  # unit std where rewards differ
    assert torch.equal(groups[2], torch.zeros(4))  # equal rewards: no signal, no NaN
    raw = group_advantages(rewards, group_size=4, scale_by_std=False).view(3, 4)
    assert torch.allclose(raw[1], torch.tensor([-0.3, -0.1, 0.1, 0.3]), atol=1e-6)
    # scaling divides each group by its own std: the ratio differs between groups
    assert raw[0, 0] / groups[0, 0] == pytest.approx(torch.tensor(rewards[:4]).std().item() + 1e-6, rel=1e-5)


def test_advantages_refuse_bad_layouts():
    with pytest.raises(ValueError, match="groups of 4"):
        group_advantages([1.0] * 6, group_size=4)
    with pytest.raises(ValueError, match="n >= 2"):
        group_advantages([1.0, 2.0], group_size=1)


def test_clipping_activates_exactly_outside_the_trust_region():
    # ratios 0.5, 0.9, 1.1, 1.5 for a positive and for a negative advantage
    ratios = torch.tensor([[0.5, 0.9, 1.1, 1.5], [0.5, 0.9, 1.1, 1.5]])
    old = torch.full_like(ratios, -2.0)
    logprobs = (old + ratios.log()).requires_grad_(True)
    mask = torch.ones_like(ratios)
    advantages = torch.tensor([1.0, -1.0])
    loss, stats = policy_loss(logprobs, old, advantages, mask, clip_low=0.2, clip_high=0.28)
    loss.backward()
    # A > 0: only ratio above 1 + clip_high is clipped (1.5); A < 0: only ratio below 1 - clip_low (0.5)
    clipped = torch.tensor([[False, False, False, True], [True, False, False, False]])
    assert torch.equal(logprobs.grad == 0, clipped)
    assert stats["clip_frac"] == pytest.approx(2 / 8)
    assert stats["ratio_mean"] == pytest.approx(float(ratios.mean()))
    expected = -(torch.tensor([0.5, 0.9, 1.1, 1.28]).sum() - torch.tensor([0.8, 0.9, 1.1, 1.5]).sum()) / 8
    assert float(loss.detach()) == pytest.approx(float(expected), abs=1e-6)
    # unclipped tokens carry the plain policy gradient: d(-A * ratio)/d logprob = -A * ratio / N
    assert float(logprobs.grad[0, 1]) == pytest.approx(-0.9 / 8, abs=1e-6)


def test_on_policy_loss_is_minus_mean_advantage_and_never_clips():
    logprobs = torch.randn(3, 5)
    mask = torch.ones(3, 5)
    loss, stats = policy_loss(logprobs, logprobs, torch.tensor([1.0, 2.0, -0.5]), mask)
    assert float(loss) == pytest.approx(-2.5 / 3, abs=1e-6)
    assert stats["clip_frac"] == 0 and stats["ratio_mean"] == pytest.approx(1.0) and stats["tokens"] == 15


def test_token_level_and_sequence_level_normalisation_differ_as_expected():
    # a long sample (4 tokens, advantage 1) and a short one (1 token, advantage -1), on policy
    logprobs = torch.zeros(2, 4)
    mask = torch.tensor([[1.0, 1, 1, 1], [1, 0, 0, 0]])
    advantages = torch.tensor([1.0, -1.0])
    token, _ = policy_loss(logprobs, logprobs, advantages, mask, token_level=True)
    sequence, _ = policy_loss(logprobs, logprobs, advantages, mask, token_level=False)
    assert float(token) == pytest.approx(-(4 - 1) / 5)  # every token weighs 1/5: the long sample wins
    assert float(sequence) == pytest.approx(0.0)  # every sample weighs 1/2: they cancel
    # masked tokens never count, whatever their values
    noisy = torch.where(mask.bool(), logprobs, torch.full_like(logprobs, 7.0))
    assert float(policy_loss(noisy, logprobs, advantages, mask)[0]) == pytest.approx(float(token))


def test_micro_batches_with_a_global_normalizer_add_up_to_the_full_batch():
    g = torch.Generator().manual_seed(0)
    logprobs, old = torch.randn(6, 5, generator=g), torch.randn(6, 5, generator=g)
    mask = (torch.rand(6, 5, generator=g) > 0.3).float()
    mask[:, 0] = 1
    advantages = torch.randn(6, generator=g)
    for token_level in (True, False):
        full, _ = policy_loss(logprobs, old, advantages, mask, token_level=token_level)
        normalizer = float(mask.sum()) if token_level else 6
        parts = sum(
            policy_loss(
                logprobs[i : i + 2],
                old[i : i + 2],
                advantages[i : i + 2],
                mask[i : i + 2],
                token_level=token_level,
                normalizer=normalizer,
            )[0]
            for i in range(0, 6, 2)
        )
        assert float(parts) == pytest.approx(float(full), abs=1e-6)


def test_k3_is_nonnegative_zero_when_equal_and_enters_the_loss():
    g = torch.Generator().manual_seed(1)
    logprobs, ref = torch.randn(4, 6, generator=g), torch.randn(4, 6, generator=g)
    mask = torch.ones(4, 6)
    mask[0, 3:] = 0
    kl = kl_k3(logprobs, ref, mask)
    assert (kl >= 0).all() and (kl[0, 3:] == 0).all() and (kl[mask.bool()] > 0).all()
    assert torch.equal(kl_k3(logprobs, logprobs, mask), torch.zeros(4, 6))
    d = float(ref[1, 0] - logprobs[1, 0])
    assert float(kl[1, 0]) == pytest.approx(math.exp(d) - d - 1, rel=1e-5)
    advantages = torch.zeros(4)
    loss, stats = policy_loss(logprobs, logprobs, advantages, mask, ref_logprobs=ref, kl_coef=0.1)
    assert float(loss) == pytest.approx(0.1 * float(aggregate(kl, mask)), rel=1e-5)
    assert stats["kl"] == pytest.approx(float(aggregate(kl, mask)), rel=1e-5)
    assert float(policy_loss(logprobs, logprobs, advantages, mask, ref_logprobs=ref, kl_coef=0.0)[0]) == 0.0


def test_logprob_mismatch_reads_only_unmasked_tokens():
    engine = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, 0.0]])
    trainer = torch.tensor([[-1.1, -2.0, -9.0], [-0.7, -1.0, 5.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    stats = logprob_mismatch(engine, trainer, mask)
    assert stats["mean"] == pytest.approx((0.1 + 0 + 0.3 + 0) / 4) and stats["max"] == pytest.approx(0.3)
    assert logprob_mismatch(engine, trainer, torch.zeros_like(mask)) == {"mean": 0.0, "max": 0.0, "tokens": 0}


def test_tis_weights_by_hand():
    """Trainer - engine logprob per token: ln 0.5, 0, ln 3 (truncated at 2), ln 1.5 (masked out)."""
    trainer = torch.tensor([[-1.0, -2.0, -0.5, -1.0]])
    engine = trainer - torch.log(torch.tensor([[0.5, 1.0, 3.0, 1.5]]))
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    weights, stats = truncated_is_weights(trainer, engine, mask, cap=2.0)
    assert weights.tolist()[0] == pytest.approx([0.5, 1.0, 2.0, 1.5])
    assert stats["ratio_mean"] == pytest.approx((0.5 + 1 + 3) / 3)
    assert stats["ratio_max"] == pytest.approx(3.0)
    assert stats["truncated_share"] == pytest.approx(1 / 3) and stats["tokens"] == 3
    off, off_stats = truncated_is_weights(trainer, engine, mask, cap=0.0)
    assert torch.equal(off, torch.ones_like(off)) and off_stats["truncated_share"] == 0
    assert off_stats["ratio_max"] == pytest.approx(3.0)  # still measured when off


def test_tis_weights_multiply_the_policy_gradient_term_by_hand():
    """On-policy ratio (1), advantage 2: each token's loss is -2 * weight; mean over 3 tokens."""
    logprobs = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    weights = torch.tensor([[0.5, 1.0, 2.0]])
    loss, _ = policy_loss(logprobs, logprobs.detach(), torch.tensor([2.0]), torch.ones(1, 3), tis_weights=weights)
    assert float(loss) == pytest.approx(-2 * (0.5 + 1.0 + 2.0) / 3)
    loss.backward()  # d(-A * w * exp(lp - old))/d lp at lp == old is -A * w, over 3 tokens
    assert logprobs.grad.tolist()[0] == pytest.approx([-2 * 0.5 / 3, -2 * 1.0 / 3, -2 * 2.0 / 3])


def test_tis_with_ratio_near_one_gives_the_uncorrected_gradient():
    """A synchronous run (engine ~ trainer, fp32): the TIS loss (ratio from the trainer's own old
    logprobs, weighted by the engine ratio) has the gradient of today's loss (ratio from the engine)."""
    g = torch.Generator().manual_seed(0)
    trainer = torch.randn(4, 6, generator=g) - 3
    engine = trainer + 1e-6 * torch.randn(4, 6, generator=g)
    advantages, mask = torch.randn(4, generator=g), (torch.rand(4, 6, generator=g) > 0.2).float()
    grads = []
    for tis in (False, True):
        logprobs = trainer.clone().requires_grad_(True)
        weights = truncated_is_weights(logprobs, engine, mask, cap=2.0)[0] if tis else None
        old = logprobs.detach() if tis else engine
        loss, _ = policy_loss(logprobs, old, advantages, mask, tis_weights=weights)
        loss.backward()
        grads.append(logprobs.grad)
    assert torch.allclose(grads[0], grads[1], atol=1e-7, rtol=1e-5)
    assert grads[0].abs().max() > 1e-3  # a real gradient, not two zeros
