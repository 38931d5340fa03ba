"""Attention over the paged KV pool, through transformers' attention-function registry.

transformers' attention layers compute q, k, v (rotary applied) and call the function registered
under the model's `_attn_implementation` with the forward's extra keyword arguments: the step's
`PagedInputs` arrive as `paged=`. The function writes the step's new keys and values into their
slots of the pool; a decode step on a GPU with Triton then reads each row's pages in place
(kv/decode_kernel.py); otherwise it gathers each row's pages and runs
`scaled_dot_product_attention` (on the CPU `invariant_attention`, whose rounding depends on a row's
own keys alone) with the query heads of one KV head folded into the query length (grouped-query
attention without repeating K and V, and a boolean mask every SDPA backend takes).

A step is packed: its tokens are `[1, T]`, row after row. A decode step feeds one token per row
(rows == tokens; the shape CUDA graphs capture, kv/graphs.py); any other step (prefills, chunks,
recomputes) is scattered into `[rows, longest, ...]` for the kernel and gathered back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from rollfleet.engine.kv import decode_kernel
from rollfleet.engine.kv.cpu_rows import rows_alike_from

ATTENTION_NAME = "rollfleet_paged"  # never "flash" in it: transformers tests the name for that word
INVARIANT_BLOCK = 16  # keys per block of invariant_attention (CPU)


@dataclass
class PagedInputs:
    """One step's layout on the device."""

    keys: list[torch.Tensor]  # per layer: [slots, kv heads, head_dim] (the pool's)
    values: list[torch.Tensor]
    page_size: int
    slots: torch.Tensor  # [T]: where each fed token's K and V go
    table: torch.Tensor  # [rows, width]: each row's pages (padded with the trash page)
    lens: torch.Tensor  # [rows]: each row's KV length once this step's tokens are in
    decode: bool  # one token per row
    kernel: bool = False  # decode reads the pages in place (kv/decode_kernel.py) instead of gathering them
    q_index: torch.Tensor | None = None  # [T]: packed token -> row * longest + index in row (None: T is rows x longest)
    q_pos: torch.Tensor | None = None  # [rows, longest]: each padded query's position (0 for padding)
    prefix: torch.Tensor | None = None  # [2, rows]: decode rows that share leading pages (kv/prefix_groups.py)
    riders: PagedInputs | None = None  # a prefill step's trailing one-token rows, in the decode layout
    ride_from: int = 0  # the packed index of the riders' first token
    _masks: dict[int, torch.Tensor] = field(default_factory=dict)
    _unwritten: torch.Tensor | None = None

    def forget_masks(self) -> None:
        """Built again on the next call (a graph capture builds them from its static buffers)."""
        self._masks.clear()
        self._unwritten = None

    def unwritten(self) -> torch.Tensor:
        """[rows, width * page_size, 1, 1] bool: the gathered key slots at or past each row's length,
        which hold whatever the pool held (another sequence's KV, or arbitrary bits after a resume)."""
        if self._unwritten is None:
            key_pos = torch.arange(self.table.shape[1] * self.page_size, device=self.lens.device)
            self._unwritten = (key_pos >= self.lens[:, None])[:, :, None, None]
        return self._unwritten

    def mask(self, group: int) -> torch.Tensor:
        """[rows, 1, queries, width * page_size] bool, built once per step (the first layer's call)."""
        if group not in self._masks:
            length = self.table.shape[1] * self.page_size
            key_pos = torch.arange(length, device=self.lens.device)
            if self.decode:
                self._masks[group] = (key_pos < self.lens[:, None])[:, None, None, :]
            else:
                causal = key_pos[None, None, :] <= self.q_pos[:, :, None]  # [rows, longest, length]
                self._masks[group] = causal.repeat_interleave(group, dim=1)[:, None]
        return self._masks[group]


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, heads, T, head_dim]
    key: torch.Tensor,  # [1, kv heads, T, head_dim]
    value: torch.Tensor,
    attention_mask,
    scaling: float | None = None,
    dropout: float = 0.0,
    paged: PagedInputs | None = None,
    **_kwargs,
) -> tuple[torch.Tensor, None]:
    assert paged is not None, f"{ATTENTION_NAME} attention runs only inside the engine's paged steps"
    layer = module.layer_idx
    pool_k, pool_v = paged.keys[layer], paged.values[layer]
    pool_k.index_copy_(0, paged.slots, key[0].transpose(0, 1).to(pool_k.dtype))
    pool_v.index_copy_(0, paged.slots, value[0].transpose(0, 1).to(pool_v.dtype))
    return attend(query[0].transpose(0, 1), paged, layer, scaling)[None], None


def attend(q: torch.Tensor, paged: PagedInputs, layer: int, scaling: float | None) -> torch.Tensor:
    """Attention of `q` [T, heads, head_dim] (the step's packed queries, rotary applied) over layer
    `layer`'s pool, whose slots hold this step's keys and values already: [T, heads, head_dim] in q's
    dtype. A prefill step's riders (`PagedInputs.riders`) attend in the decode layout, apart."""
    if paged.riders is None:
        return _attend(q, paged, layer, scaling)
    split = paged.ride_from
    return torch.cat([_attend(q[:split], paged, layer, scaling), _attend(q[split:], paged.riders, layer, scaling)])


def _attend(q: torch.Tensor, paged: PagedInputs, layer: int, scaling: float | None) -> torch.Tensor:
    pool_k, pool_v = paged.keys[layer], paged.values[layer]
    rows, kv_heads, head_dim = paged.table.shape[0], pool_k.shape[1], pool_k.shape[2]
    tokens, heads = q.shape[0], q.shape[1]
    group = heads // kv_heads
    if paged.decode and paged.kernel:
        scale = head_dim**-0.5 if scaling is None else scaling
        out = decode_kernel.decode_attention(
            q.to(pool_k.dtype), pool_k, pool_v, paged.table, paged.lens, paged.page_size, scale, paged.prefix
        )
        return out.to(q.dtype)
    grouped = q.reshape(tokens, kv_heads, group, head_dim)
    if paged.decode:
        out = _over_pages(grouped, pool_k, pool_v, paged, group, scaling)
        return out.reshape(tokens, heads, head_dim).to(q.dtype)
    longest = paged.q_pos.shape[1]
    padded = grouped  # q_index None: the step feeds the padded layout itself (kv/prefill_graphs.py)
    if paged.q_index is not None:
        padded = grouped.new_zeros(rows * longest, kv_heads, group, head_dim)
        padded[paged.q_index] = grouped
    padded = padded.view(rows, longest, kv_heads, group, head_dim).permute(0, 2, 1, 3, 4)
    padded = padded.reshape(rows, kv_heads, longest * group, head_dim)
    out = _over_pages(padded, pool_k, pool_v, paged, group, scaling)
    out = out.view(rows, kv_heads, longest, group, head_dim).permute(0, 2, 1, 3, 4)
    out = out.reshape(rows * longest, heads, head_dim)
    return (out if paged.q_index is None else out[paged.q_index]).to(q.dtype)


def _over_pages(queries, pool_k, pool_v, paged: PagedInputs, group: int, scaling) -> torch.Tensor:
    """Each row's queries over its gathered pages: SDPA on a GPU; on the CPU `invariant_attention`,
    whose rounding depends on nothing but the row's own keys."""
    mask = paged.mask(group)
    k, v = _gather(pool_k, paged), _gather(pool_v, paged)
    if queries.device.type != "cpu":
        return F.scaled_dot_product_attention(queries.to(k.dtype), k, v, attn_mask=mask, scale=scaling)
    return invariant_attention(queries, k, v, mask, queries.shape[-1] ** -0.5 if scaling is None else scaling)


def invariant_attention(q, k, v, mask, scale: float) -> torch.Tensor:
    """Attention (q [rows, heads, queries, dim] over k, v [rows, heads, keys, dim], `mask` [rows, 1,
    queries or 1, keys] True where a query sees a key) whose result for a query is the same to the bit
    whatever the number of keys past the ones it sees, the number of queries beside it and the rows
    beside its row. So on the CPU a token's logits depend on its sequence alone, not on how its
    prompt was chunked, how much of it the prefix cache held, or what shared its steps: a seeded run
    repeats to the bit however its requests met (an agent run's turns meet as their tools answer).
    torch's CPU SDPA does not: its kernel splits keys and queries into blocks by their number, and
    products over 1-3 query rows round otherwise (1e-7 in the logits).
    How: keys in blocks of INVARIANT_BLOCK (the last padded), every block's products one batched
    product of one shape, over at least as many queries as this CPU needs to round them alike
    (kv/cpu_rows.py); the blocks' sums added in order (a cumulative sum, sequential), where a block no
    query sees adds exact zeros. In float32."""
    rows, heads, queries, dim = q.shape
    q, k, v = q.float(), k.float(), v.float()
    mask = mask.expand(rows, 1, queries, k.shape[2])
    least = rows_alike_from((dim, INVARIANT_BLOCK), batched=True)
    if queries < least:  # padded queries see every key (no row of -inf); dropped at the end
        q = torch.cat([q, q.new_zeros(rows, heads, least - queries, dim)], 2)
        mask = torch.cat([mask, mask.new_ones(rows, 1, least - queries, mask.shape[3])], 2)
    pad = -k.shape[2] % INVARIANT_BLOCK
    if pad:
        k, v = (torch.cat([t, t.new_zeros(rows, heads, pad, dim)], 2) for t in (k, v))
        mask = torch.cat([mask, mask.new_zeros(*mask.shape[:3], pad)], 3)
    blocks, fed = k.shape[2] // INVARIANT_BLOCK, q.shape[2]
    k, v = (t.view(rows, heads, blocks, INVARIANT_BLOCK, dim) for t in (k, v))
    seen = mask.view(rows, 1, fed, blocks, INVARIANT_BLOCK).transpose(2, 3)
    scores = torch.matmul(q[:, :, None], k.transpose(-1, -2)).mul_(scale).masked_fill_(~seen, float("-inf"))
    weights = torch.exp(scores - scores.amax(dim=(2, 4), keepdim=True))  # [rows, heads, blocks, fed, block]
    total = weights.sum(-1, keepdim=True).cumsum(2)[:, :, -1]
    out = torch.matmul(weights, v).cumsum(2)[:, :, -1]
    return (out / total)[:, :, :queries]


def _gather(pool: torch.Tensor, paged: PagedInputs) -> torch.Tensor:
    """[rows, kv heads, width * page_size, head_dim]: each row's pages, in order, with the slots past
    the row's length zeroed. The mask gives those slots zero weight, but zero times a NaN or an
    infinity left in the pool is NaN: zeroed, whatever the pool holds cannot reach the output."""
    table, page_size = paged.table, paged.page_size
    pages = pool.view(-1, page_size, pool.shape[1], pool.shape[2])[table]  # [rows, width, page, heads, dim]
    rows, width = table.shape
    keys = pages.view(rows, width * page_size, pool.shape[1], pool.shape[2]).masked_fill_(paged.unwritten(), 0)
    return keys.transpose(1, 2)


AttentionInterface.register(ATTENTION_NAME, paged_attention)
