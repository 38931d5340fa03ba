"""The common step of sampling.py in one pass over the logits: a Triton kernel (GPUs with Triton).

For rows that are greedy or draw from plain softmax(logits / temperature) (no top-k, top-p or
min-p, no top-k or chosen-id logprobs: a GRPO rollout's rows), one program per row reads its
logits once and keeps, block by block, the Gumbel-max draw (noise from Triton's counter-based
`tl.rand`, seeded per step; a row with a `sampling_seed`: sampling.py's hashed noise of its step
key, the same bits as the general path's) and the running log-sum-exp, so the token and its
logprob come out without the `[rows, vocab]` float32 copies, noise and passes of the general path
(about 2.7 ms a step at 512 x 151,936 on an H200). Same conventions as sampling.py: greedy rows
take the first argmax of the raw logits and the raw log_softmax; the others' logprob is
log_softmax(logits / temperature) at the drawn token, clamped to float32's lowest value.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU builds of torch come without Triton: sampling.py's general path serves
    triton = None

BLOCK_V = 2048  # vocabulary entries per inner step
TINY = float(torch.finfo(torch.float32).tiny)
LOWEST = float(torch.finfo(torch.float32).min)


def available(device: torch.device) -> bool:
    return triton is not None and device.type == "cuda"


def fused_sample(
    logits: torch.Tensor,
    inv_temperature: torch.Tensor,
    greedy: torch.Tensor,
    seed: int,
    keys: torch.Tensor | None = None,
    block=BLOCK_V,
):
    """`logits` [rows, vocab] (any float dtype, last dim contiguous), per row 1 / temperature
    (float32) and greedy (bool), and optionally `keys` (int64: a seeded row's step key, sampling.py
    `step_key`; -1 for the step's own noise): (tokens int64 [rows], logprobs float32 [rows]) on the
    device. A seeded row's noise is sampling.py's `hashed_uniform` of its key, the same bits."""
    rows, vocab = logits.shape
    assert logits.stride(1) == 1, "the kernel reads each row's logits contiguously"
    tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(rows, dtype=torch.float32, device=logits.device)
    _sample_kernel[(rows,)](
        logits, logits.stride(0), inv_temperature, greedy, seed, keys if keys is not None else tokens,
        tokens, logprobs, VOCAB=vocab, SEEDED=keys is not None, TINY=TINY, LOWEST=LOWEST, BLOCK=block,
    )  # fmt: skip
    return tokens, logprobs


if triton is not None:

    @triton.jit
    def _sample_kernel(
        logits_ptr, row_stride, inv_temp_ptr, greedy_ptr, seed, keys_ptr, tokens_ptr, logprobs_ptr,
        VOCAB: tl.constexpr, SEEDED: tl.constexpr, TINY: tl.constexpr, LOWEST: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0)
        key = tl.load(keys_ptr + row) if SEEDED else -1  # a seeded row's step key
        greedy = tl.load(greedy_ptr + row) != 0
        inv_t = tl.where(greedy, 1.0, tl.load(inv_temp_ptr + row))
        base = logits_ptr + row.to(tl.int64) * row_stride
        lanes = tl.arange(0, BLOCK)
        best = tl.full([], float("-inf"), tl.float32)  # the largest score so far (scaled logit + noise)
        best_x = tl.full([], float("-inf"), tl.float32)  # its scaled logit
        best_i = tl.full([], 0, tl.int64)
        m = tl.full([], float("-inf"), tl.float32)  # log-sum-exp of the scaled logits, online
        total = tl.full([], 0.0, tl.float32)
        for start in range(0, VOCAB, BLOCK):  # VOCAB a constant (one compile an engine): the CPU interpreter runs it
            ids = start + lanes
            live = ids < VOCAB
            x = tl.load(base + ids, mask=live, other=float("-inf")).to(tl.float32) * inv_t
            u = tl.rand(seed, row * VOCAB + ids)
            if SEEDED:
                u = tl.where(key >= 0, _hashed_uniform(key, ids), u)
            gumbel = -tl.log(tl.maximum(-tl.log(u), TINY))  # an exact 0 of Exp(1) would make its token certain
            score = tl.where(live, x + tl.where(greedy, 0.0, gumbel), float("-inf"))
            block_best = tl.max(score, 0)
            block_at = tl.argmax(score, 0)  # the first of equal maxima, as torch.argmax
            block_x = tl.sum(tl.where(lanes == block_at, x, 0.0), 0)
            take = block_best > best  # strictly: an earlier block's equal maximum stays first
            best_i = tl.where(take, (start + block_at).to(tl.int64), best_i)
            best_x = tl.where(take, block_x, best_x)
            best = tl.maximum(best, block_best)
            m_new = tl.maximum(m, tl.max(x, 0))
            seen = m_new > float("-inf")  # a block of banned tokens only adds nothing (no -inf - -inf)
            total = tl.where(seen, total * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0), total)
            m = m_new
        tl.store(tokens_ptr + row, best_i)
        tl.store(logprobs_ptr + row, tl.maximum(best_x - (m + tl.log(total)), LOWEST))

    @triton.jit
    def _hashed_uniform(key, ids):
        """sampling.py's `hashed_uniform` of one row: int64 arithmetic on values below 2**32 (every
        product below 2**63), 24 bits of the hash as a float32 in (0, 1), the same bits as torch's."""
        mask = 0xFFFFFFFF
        x = key ^ ((ids.to(tl.int64) * 0x61C88647) & mask)
        x = x ^ (x >> 16)
        x = (x * 0x7FEB352D) & mask
        x = x ^ (x >> 15)
        x = (x * 0x5BD1E995) & mask
        x = x ^ (x >> 13)
        x = (x * 0x2C1B3C6D) & mask
        x = x ^ (x >> 16)
        return ((x >> 8).to(tl.float32) + 0.5) / 16777216.0
