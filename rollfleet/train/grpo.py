"""GRPO math in plain torch: group-normalised advantages, the clipped policy loss, k3 KL, truncated
importance sampling against the engines' behaviour policy, and the engine-vs-trainer logprob mismatch.

Shapes: per-token tensors are [batch, seq] over the OUTPUT tokens of each sample (prompt and padding
masked out by `mask`, 1 for a trained token and 0 elsewhere); advantages are [batch] (one per sample,
broadcast over its tokens) or [batch, seq].

Normalisation. `policy_loss` returns a SUM over this call's tokens (or sequences) divided by
`normalizer`. Left at None, the normaliser is this call's own token count (token_level) or sequence
count, i.e. the plain mean. A trainer that splits one batch into micro-batches and ranks passes the
whole batch's count instead, so the micro-batch losses add up to exactly the full-batch loss.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def group_advantages(
    rewards: Tensor | Sequence[float], group_size: int, *, scale_by_std: bool = True, eps: float = 1e-6
) -> Tensor:
    """(r - mean of its group) [/ (std of its group + eps)] for rewards laid out group by group.

    `rewards` has B*G entries: the G samples of prompt i sit at [i*G, (i+1)*G). The std is the
    unbiased one (as in DeepSeekMath's GRPO); `scale_by_std=False` keeps only the mean baseline
    (Dr. GRPO), which does not up-weight groups whose rewards barely differ. A group whose rewards
    are all equal gets advantage 0 either way.
    """
    rewards = torch.as_tensor(rewards, dtype=torch.float32)
    if rewards.dim() != 1:
        raise ValueError(f"rewards has shape {tuple(rewards.shape)}: pass a flat list of B*G rewards")
    if group_size < 2:
        raise ValueError(f"group_size={group_size}: a group of one has no baseline (fix: sample n >= 2 per prompt)")
    if rewards.numel() % group_size:
        raise ValueError(
            f"{rewards.numel()} rewards do not split into groups of {group_size} "
            "(fix: pass all n samples of every prompt, group by group)"
        )
    groups = rewards.view(-1, group_size)
    advantages = groups - groups.mean(dim=1, keepdim=True)
    if scale_by_std:
        advantages = advantages / (groups.std(dim=1, keepdim=True) + eps)
    return advantages.view(-1)


def _per_token_advantages(advantages: Tensor, like: Tensor) -> Tensor:
    return advantages.unsqueeze(-1).expand_as(like) if advantages.dim() == 1 else advantages


def aggregate(values: Tensor, mask: Tensor, *, token_level: bool = True, normalizer: float | None = None) -> Tensor:
    """Masked reduction of per-token values to a scalar.

    token_level: sum over every unmasked token / normalizer (default: number of unmasked tokens).
    Otherwise: each sequence's mean over its tokens, summed / normalizer (default: number of rows).
    Token level weights every token alike (long samples weigh more); sequence level weights every
    sample alike (each token of a long sample weighs less).
    """
    mask = mask.to(values.dtype)
    if token_level:
        total, count = (values * mask).sum(), mask.sum()
    else:
        total, count = ((values * mask).sum(-1) / mask.sum(-1).clamp(min=1)).sum(), mask.shape[0]
    if normalizer is not None:
        count = normalizer
    return total / max(float(count), 1.0)


def kl_k3(logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor) -> Tensor:
    """Per-token k3 estimate of KL(policy || reference): exp(d) - d - 1 with d = ref - policy.

    Schulman's estimator ("Approximating KL divergence", 2020): unbiased, always >= 0, 0 where the
    two logprobs are equal. Masked positions are 0; reduce with `aggregate`.
    """
    delta = ref_logprobs - logprobs
    return (torch.exp(delta) - delta - 1) * mask.to(logprobs.dtype)


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    token_level: bool = True,
    ref_logprobs: Tensor | None = None,
    kl_coef: float = 0.0,
    normalizer: float | None = None,
    tis_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Clipped policy-gradient loss on ratio = exp(logprobs - old_logprobs).

    Per token: max(-A * ratio, -A * clamp(ratio, 1 - clip_low, 1 + clip_high)), plus
    kl_coef * k3(policy || reference) when `ref_logprobs` is given and kl_coef > 0. The token is
    "clipped" where the clamped term is the larger one (its gradient is then zero). `tis_weights`
    (per token, no gradient; `truncated_is_weights`) multiply the policy-gradient term, not the KL.

    Returns (loss, stats); stats are means over this call's unmasked tokens (`tokens` says how many,
    so callers can combine calls token-weighted): clip_frac, ratio_mean, kl (0 without a reference).
    """
    mask = mask.to(logprobs.dtype)
    advantages = _per_token_advantages(advantages.to(logprobs.dtype), logprobs)
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(unclipped, clipped)
    if tis_weights is not None:
        per_token = per_token * tis_weights.detach().to(per_token.dtype)
    kl = None
    if ref_logprobs is not None and kl_coef > 0:
        kl = kl_k3(logprobs, ref_logprobs, mask)
        per_token = per_token + kl_coef * kl
    loss = aggregate(per_token, mask, token_level=token_level, normalizer=normalizer)
    with torch.no_grad():
        tokens = mask.sum()
        denom = tokens.clamp(min=1)
        stats = {
            "clip_frac": float(((clipped > unclipped).to(mask.dtype) * mask).sum() / denom),
            "ratio_mean": float((ratio * mask).sum() / denom),
            "kl": float((kl.detach().sum() / denom) if kl is not None else 0.0),
            "tokens": int(tokens),
        }
    return loss, stats


def truncated_is_weights(
    trainer_logprobs: Tensor, engine_logprobs: Tensor, mask: Tensor, cap: float
) -> tuple[Tensor, dict[str, float]]:
    """Truncated importance sampling (TIS) weights for tokens the engines sampled: per token
    min(exp(trainer - engine), cap), no gradient.

    The engines' logprobs are the behaviour policy (what actually sampled the tokens: older weights
    in an asynchronous run, other kernels and precision always); the trainer's logprobs of its
    pre-update weights are the policy the loss's ratio starts from. The weight corrects the
    gradient for the difference, truncated at `cap` so a token the engine found unlikely cannot
    dominate (as verl's and slime's TIS). `cap` 0 turns it off: weights are 1.

    Stats over unmasked tokens, of the ratio before truncation: ratio_mean, ratio_max,
    truncated_share (the share of tokens whose ratio exceeded the cap), tokens.
    """
    mask = mask.to(torch.bool)
    ratio = torch.exp(trainer_logprobs.detach() - engine_logprobs.detach())
    weights = torch.clamp(ratio, max=cap) if cap > 0 else torch.ones_like(ratio)
    seen = ratio[mask]
    if seen.numel() == 0:
        return weights, {"ratio_mean": 0.0, "ratio_max": 0.0, "truncated_share": 0.0, "tokens": 0}
    truncated = float((seen > cap).float().mean()) if cap > 0 else 0.0
    stats = {"ratio_mean": float(seen.mean()), "ratio_max": float(seen.max()), "truncated_share": truncated}
    return weights, {**stats, "tokens": int(seen.numel())}


def logprob_mismatch(engine_logprobs: Tensor, trainer_logprobs: Tensor, mask: Tensor) -> dict[str, float]:
    """Mean and max |engine - trainer| logprob over unmasked tokens (0 when there are none).

    Large values mean the engine sampled from a different distribution than the trainer scores
    (stale weights, precision, a kernel or sampling bug); on CPU in fp32 they are ~1e-6.
    """
    mask = mask.bool()
    diff = (engine_logprobs.detach() - trainer_logprobs.detach()).abs()[mask]
    if diff.numel() == 0:
        return {"mean": 0.0, "max": 0.0, "tokens": 0}
    return {"mean": float(diff.mean()), "max": float(diff.max()), "tokens": int(diff.numel())}
