"""The paged decode kernel (kv/decode_kernel.py) against the gather + SDPA path it replaces.

It runs where Triton runs (tests/triton_here.py).
"""

from __future__ import annotations

import random

import pytest
import torch
from triton_here import triton_device

DEVICE = triton_device()

from rollfleet.engine.kv import decode_kernel  # noqa: E402 - after triton_device()
from rollfleet.engine.kv.attention import PagedInputs, paged_attention  # noqa: E402

DTYPE = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32


class _Layer(torch.nn.Module):
    layer_idx = 0


def _case(rows: int, heads: int, kv_heads: int, dim: int, page: int, longest: int, seed: int):
    """A pool with each row's pages scattered over it, and one new token a row to attend with."""
    gen = random.Random(seed)
    lens = [gen.randint(1, longest) for _ in range(rows)]
    lens[0] = longest
    need = [-(-n // page) for n in lens]
    pages = list(range(1, sum(need) + 1))
    gen.shuffle(pages)  # a row's pages are anywhere in the pool, in any order
    width = max(need) + gen.randint(0, 2)  # the table padded past the widest row (as graphs do)
    table, at = [], 0
    for count in need:
        table.append(pages[at : at + count] + [0] * (width - count))
        at += count
    torch.manual_seed(seed)
    slots = (sum(need) + 1) * page
    pool_k = torch.randn(slots, kv_heads, dim, dtype=DTYPE, device=DEVICE)
    pool_v = torch.randn(slots, kv_heads, dim, dtype=DTYPE, device=DEVICE)
    new_slots = [table[r][(n - 1) // page] * page + (n - 1) % page for r, n in enumerate(lens)]
    inputs = PagedInputs(
        [pool_k],
        [pool_v],
        page,
        slots=torch.tensor(new_slots, device=DEVICE),
        table=torch.tensor(table, device=DEVICE),
        lens=torch.tensor(lens, device=DEVICE),
        decode=True,
    )
    query = torch.randn(1, heads, rows, dim, dtype=DTYPE, device=DEVICE)
    key = torch.randn(1, kv_heads, rows, dim, dtype=DTYPE, device=DEVICE)
    value = torch.randn(1, kv_heads, rows, dim, dtype=DTYPE, device=DEVICE)
    return inputs, query, key, value


@pytest.mark.parametrize(
    "rows, heads, kv_heads, dim, page, longest",
    [
        (1, 16, 4, 128, 16, 700),  # one row over many pages: split across programs
        (5, 8, 8, 64, 16, 90),  # no grouping
        (7, 14, 2, 64, 4, 130),  # a group of 7 (padded to 16 in the kernel), small pages
        (33, 16, 4, 128, 1, 40),  # pages of one token
        (3, 4, 1, 32, 64, 200),  # pages larger than the kernel's block of keys
        (130, 16, 8, 64, 16, 50),  # enough programs without splitting: one split a row, then the merge
    ],
)
def test_kernel_equals_the_gather_path(rows, heads, kv_heads, dim, page, longest):
    inputs, query, key, value = _case(rows, heads, kv_heads, dim, page, longest, seed=rows + dim)
    scale = dim**-0.5
    reference, _ = paged_attention(_Layer(), query, key, value, None, scaling=scale, paged=inputs)
    inputs.kernel = True
    fast, _ = paged_attention(_Layer(), query, key, value, None, scaling=scale, paged=inputs)
    assert fast.shape == reference.shape == (1, rows, heads, dim)
    tolerance = 2e-2 if DTYPE == torch.bfloat16 else 1e-4
    torch.testing.assert_close(fast.float(), reference.float(), atol=tolerance, rtol=tolerance)


def test_splits_depend_on_the_shape_alone_and_cover_the_table():
    for rows, kv_heads, width, page in [(1, 4, 20, 16), (512, 4, 24, 16), (3, 1, 1, 1), (64, 8, 200, 16)]:
        splits, per_split = decode_kernel.splits_for(rows, kv_heads, width, page)
        assert per_split % decode_kernel.BLOCK_N == 0
        assert (splits - 1) * per_split < width * page <= splits * per_split
        assert (splits, per_split) == decode_kernel.splits_for(rows, kv_heads, width, page)


@pytest.mark.parametrize(
    "requests, samples, prompt, heads, kv_heads, dim, page",
    [
        (3, 8, 64, 16, 4, 128, 16),  # GRPO's shape: each request's samples over its prompt's pages
        (2, 5, 33, 8, 8, 64, 4),  # a prompt that ends inside a page: that page is the samples' own
        (1, 20, 48, 14, 2, 32, 16),  # a group larger than one tile of the prefix kernel (9 rows of 7 heads)
        (4, 1, 32, 4, 1, 32, 16),  # no group: the prefix pass writes nothing
    ],
)
def test_the_prefix_pass_equals_reading_every_row_whole(requests, samples, prompt, heads, kv_heads, dim, page):
    from rollfleet.engine.kv.prefix_groups import MAX_MEMBERS, prefix_groups

    gen = random.Random(requests * samples)
    tables, lens, fresh = [], [], 1
    for _ in range(requests):
        shared = list(range(fresh, fresh + prompt // page))
        fresh += len(shared)
        for _ in range(samples):
            length = prompt + gen.randint(1, 40)
            own = -(-length // page) - len(shared)
            tables.append(shared + list(range(fresh, fresh + own)))
            fresh += own
            lens.append(length)
    width = max(map(len, tables)) + 1
    table = torch.tensor([pages + [0] * (width - len(pages)) for pages in tables], device=DEVICE)
    torch.manual_seed(requests)
    pool_k, pool_v = (torch.randn(fresh * page, kv_heads, dim, dtype=DTYPE, device=DEVICE) for _ in range(2))
    q = torch.randn(len(tables), heads, dim, dtype=DTYPE, device=DEVICE)
    lens_t = torch.tensor(lens, device=DEVICE)
    prefix = torch.tensor(prefix_groups(tables, lens, page, MAX_MEMBERS), device=DEVICE)
    assert (prefix[0] > 1).sum() == (requests if samples > 1 and prompt >= page else 0)
    whole = decode_kernel.decode_attention(q, pool_k, pool_v, table, lens_t, page, dim**-0.5)
    shared = decode_kernel.decode_attention(q, pool_k, pool_v, table, lens_t, page, dim**-0.5, prefix=prefix)
    tolerance = 2e-2 if DTYPE == torch.bfloat16 else 1e-5
    torch.testing.assert_close(shared.float(), whole.float(), atol=tolerance, rtol=tolerance)
