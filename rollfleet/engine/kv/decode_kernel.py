"""Decode attention straight from the paged pool: a Triton kernel that reads each row's pages
through its block table, once (flash decoding), instead of gathering them into a dense copy.

One program per (row, KV head, split of the row's pages) computes the softmax of its query heads
(the KV head's group, GQA without repeating K and V) over its pages with an online softmax and
writes a partial output and its log-sum-exp; a second kernel merges a row's splits. Splits keep
the GPU busy when the batch is small (a latency run is one row over many pages). With `prefix`
(kv/prefix_groups.py: rows that share leading pages, a request's samples over its prompt) a third
kernel reads each group's shared keys once for all its rows' queries, into extra slots of their
partials, and the split kernel reads each row's keys past them (a cascade); the merge takes both.

Triton comes with torch's CUDA builds; without it (CPU, or a build without Triton) attention.py
keeps its gather + SDPA path, which is also the reference the GPU check compares against
(tests/test_kv_decode_kernel.py; on CPU it runs under TRITON_INTERPRET=1 when triton is installed).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU builds of torch come without Triton: attention.py's gather path serves
    triton = None

BLOCK_N = 32  # keys per inner step (two pages of 16): the fastest of 32/64/128 at batch 512 and at 1 on an H200
LAUNCH = {"num_warps": 4, "num_stages": 2}  # the sweep's best with BLOCK_N 32 (101 us a layer at batch 512)
TARGET_PROGRAMS = 1024  # enough programs to fill an H200's 132 SMs a few times over
PREFIX_QUERIES = 64  # query heads one program of the prefix kernel takes: rows x a KV head's group


def available(device: torch.device) -> bool:
    return triton is not None and device.type == "cuda"


def splits_for(rows: int, kv_heads: int, width: int, page_size: int) -> tuple[int, int]:
    """(splits, keys per split) for a step of `rows` rows of block-table width `width`; a function of
    the shape alone, so a CUDA graph captures the same launch it replays."""
    keys = width * page_size
    blocks = -(-keys // BLOCK_N)
    splits = max(1, min(blocks, -(-TARGET_PROGRAMS // (rows * kv_heads))))
    per_split = -(-blocks // splits) * BLOCK_N
    return -(-keys // per_split), per_split


def decode_attention(
    q, pool_k, pool_v, table, lens, page_size: int, scale: float, prefix: torch.Tensor | None = None, **launch
) -> torch.Tensor:
    """`q` [rows, heads, dim] (one query a row), the pool's `[slots, kv heads, dim]` K and V, `table`
    [rows, width] pages, `lens` [rows] keys per row: `[rows, heads, dim]` in q's dtype. `prefix`
    ([2, rows], `prefix_groups`): rows that share their leading pages read them once, together.
    `launch`: Triton's num_warps / num_stages for the split kernel (`LAUNCH` otherwise)."""
    rows, heads, dim = q.shape
    kv_heads = pool_k.shape[1]
    group = heads // kv_heads
    splits, per_split = splits_for(rows, kv_heads, table.shape[1], page_size)
    slots = splits + (splits if prefix is not None else 0)
    partial = torch.empty(rows, heads, slots, dim, dtype=torch.float32, device=q.device)
    lse = torch.empty(rows, heads, slots, dtype=torch.float32, device=q.device)
    if prefix is not None:  # the prefix kernel writes the slots of its groups' rows alone
        lse.fill_(float("-inf"))
    common = dict(
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), DIM=dim,
        DIM_PAD=triton.next_power_of_2(dim), PAGE=page_size, BLOCK=BLOCK_N,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # float32 stays float32 (no TF32)
    )  # fmt: skip
    strides = (
        q.stride(0), q.stride(1), pool_k.stride(0), pool_k.stride(1), pool_v.stride(0), pool_v.stride(1),
        table.stride(0), scale, per_split, slots,
    )  # fmt: skip
    skip = prefix[1] if prefix is not None else lens  # any [rows] tensor: ignored without HAS_PREFIX
    _split_kernel[(rows, kv_heads, splits)](
        q, pool_k, pool_v, table, lens, skip, partial, lse, *strides, HAS_PREFIX=prefix is not None,
        **common, **{**LAUNCH, **launch},
    )  # fmt: skip
    if prefix is not None:
        members = max(1, PREFIX_QUERIES // group)
        _prefix_kernel[(rows, kv_heads, splits)](
            q, pool_k, pool_v, table, prefix, partial, lse, *strides, splits,
            MEMBERS=members, QUERIES=max(16, triton.next_power_of_2(members * group)), **common, **LAUNCH,
        )  # fmt: skip
    out = torch.empty(rows, heads, dim, dtype=q.dtype, device=q.device)
    _merge_kernel[(rows, heads)](
        partial, lse, out, slots, dim, SPLITS_PAD=triton.next_power_of_2(slots), DIM_PAD=triton.next_power_of_2(dim)
    )
    return out


if triton is not None:

    @triton.jit
    def _over_keys(
        q, begin, end, table_ptr, k_ptr, v_ptr, k_slot, v_slot, scale,
        ROWS: tl.constexpr, DIM: tl.constexpr, DIM_PAD: tl.constexpr, PAGE: tl.constexpr, BLOCK: tl.constexpr,
        PRECISION: tl.constexpr,
    ):  # fmt: skip
        """The online softmax of `q` [ROWS, DIM_PAD] over keys [begin, end) of one table row (`table_ptr`)
        and one KV head (`k_ptr`, `v_ptr` at its head): (running max, sum of weights, weighted values)."""
        d = tl.arange(0, DIM_PAD)
        m = tl.full([ROWS], float("-inf"), tl.float32)
        total = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, DIM_PAD], tl.float32)
        for start in range(begin, end, BLOCK):
            n = start + tl.arange(0, BLOCK)
            live = n < end
            page = tl.load(table_ptr + n // PAGE, mask=live, other=0)
            slot = page * PAGE + n % PAGE
            kv_mask = live[:, None] & (d[None, :] < DIM)
            k = tl.load(k_ptr + slot[:, None] * k_slot + d[None, :], mask=kv_mask, other=0.0)
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32) * scale
            scores = tl.where(live[None, :], scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, 1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(scores - m_new[:, None])
            total = total * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + slot[:, None] * v_slot + d[None, :], mask=kv_mask, other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION).to(tl.float32)
            m = m_new
        return m, total, acc

    @triton.jit
    def _split_kernel(
        q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, skip_ptr, part_ptr, lse_ptr,
        q_row, q_head, k_slot, k_head, v_slot, v_head, table_row, scale, per_split, slots,
        HAS_PREFIX: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, DIM: tl.constexpr,
        DIM_PAD: tl.constexpr,
        PAGE: tl.constexpr, BLOCK: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        row, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        length = tl.load(lens_ptr + row)
        skip = tl.load(skip_ptr + row) if HAS_PREFIX else 0  # keys the prefix kernel reads for this row
        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, DIM_PAD)
        heads = kv_head * GROUP + g
        q = tl.load(
            q_ptr + row * q_row + heads[:, None] * q_head + d[None, :],
            mask=(g[:, None] < GROUP) & (d[None, :] < DIM),
            other=0.0,
        )
        begin = skip + split * per_split
        end = tl.minimum(begin + per_split, length)
        m, total, acc = _over_keys(
            q, begin, end, table_ptr + row * table_row, k_ptr + kv_head * k_head, v_ptr + kv_head * v_head,
            k_slot, v_slot, scale, GROUP_PAD, DIM, DIM_PAD, PAGE, BLOCK, PRECISION,
        )  # fmt: skip
        empty = begin >= length
        out_heads = (row * GROUP * tl.num_programs(1) + heads) * slots + split
        keep = g < GROUP
        tl.store(lse_ptr + out_heads, tl.where(empty, float("-inf"), m + tl.log(total)), mask=keep)
        result = tl.where(empty, 0.0, acc / total[:, None])
        tl.store(part_ptr + out_heads[:, None] * DIM + d[None, :], result, mask=keep[:, None] & (d[None, :] < DIM))

    @triton.jit
    def _prefix_kernel(
        q_ptr, k_ptr, v_ptr, table_ptr, prefix_ptr, part_ptr, lse_ptr,
        q_row, q_head, k_slot, k_head, v_slot, v_head, table_row, scale, per_split, slots, first_slot,
        MEMBERS: tl.constexpr, QUERIES: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
        DIM: tl.constexpr, DIM_PAD: tl.constexpr, PAGE: tl.constexpr, BLOCK: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        """A group's leading row: its members' queries (rows row.. row + count - 1, this KV head's
        group of query heads each) over the keys they share, read once through the leader's table,
        into the members' slots past the split kernel's."""
        row, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        count = tl.load(prefix_ptr + row)  # 0 where the row leads no group
        shared = tl.load(prefix_ptr + tl.num_programs(0) + row)
        begin = split * per_split
        end = tl.where(count > 1, tl.minimum(begin + per_split, shared), begin)
        i = tl.arange(0, QUERIES)
        d = tl.arange(0, DIM_PAD)
        heads = kv_head * GROUP + i % GROUP
        for first in range(0, tl.where(begin < end, count, 0), MEMBERS):  # members by MEMBERS rows at a time
            member = first + i // GROUP
            live = (member < count) & (i // GROUP < MEMBERS)
            q = tl.load(
                q_ptr + (row + member)[:, None] * q_row + heads[:, None] * q_head + d[None, :],
                mask=live[:, None] & (d[None, :] < DIM),
                other=0.0,
            )
            m, total, acc = _over_keys(
                q, begin, end, table_ptr + row * table_row, k_ptr + kv_head * k_head, v_ptr + kv_head * v_head,
                k_slot, v_slot, scale, QUERIES, DIM, DIM_PAD, PAGE, BLOCK, PRECISION,
            )  # fmt: skip
            out_heads = ((row + member) * GROUP * tl.num_programs(1) + heads) * slots + first_slot + split
            tl.store(lse_ptr + out_heads, m + tl.log(total), mask=live)
            out_mask = live[:, None] & (d[None, :] < DIM)
            tl.store(part_ptr + out_heads[:, None] * DIM + d[None, :], acc / total[:, None], mask=out_mask)

    @triton.jit
    def _merge_kernel(part_ptr, lse_ptr, out_ptr, splits, dim, SPLITS_PAD: tl.constexpr, DIM_PAD: tl.constexpr):
        row, head = tl.program_id(0), tl.program_id(1)
        heads = tl.num_programs(1)
        s = tl.arange(0, SPLITS_PAD)
        d = tl.arange(0, DIM_PAD)
        base = (row * heads + head) * splits
        lse = tl.load(lse_ptr + base + s, mask=s < splits, other=float("-inf"))
        weight = tl.exp(lse - tl.max(lse, 0))
        weight = weight / tl.sum(weight, 0)
        part = tl.load(  # a slot no kernel wrote (lse -inf, weight 0) holds whatever was there: not read
            part_ptr + (base + s[:, None]) * dim + d[None, :],
            mask=(s[:, None] < splits) & (weight[:, None] > 0) & (d[None, :] < dim),
            other=0.0,
        )
        out = tl.sum(part * weight[:, None], 0)
        tl.store(out_ptr + (row * heads + head) * dim + d, out.to(out_ptr.dtype.element_ty), mask=d < dim)
