"""Decode attention alone over 24 layers' pools at batch 512 (the benches' 2.08B shape: 16 query heads,
4 KV heads, head_dim 128, pages of 16), with each request's 8 samples over a shared prompt: the decode
kernel (kv/decode_kernel.py) reading every row whole, against its prefix pass (kv/prefix_groups.py).
Prints ms a step (the 24 layers replayed from a CUDA graph, mean of 20) for each layout:
  distinct   every row's pages its own (no sharing at all)
  shared     a request's 8 rows over the same prompt pages, each row reading them (the L2 cache may
             serve the group's later rows)
  scattered  the same pages, the batch's rows shuffled (a group's rows apart in the grid)
  prefix     shared, with the prefix pass (the group's prompt pages read once for its rows)
and the largest difference of the prefix pass's output from the plain kernel's (bf16), as a table. GPU only.

    python scripts/bench_prefix_attention.py
"""

from __future__ import annotations

import torch

from rollfleet.engine.kv.decode_kernel import decode_attention
from rollfleet.engine.kv.prefix_groups import MAX_MEMBERS, prefix_groups

PAGE, HEADS, KV_HEADS, DIM, LAYERS, ROWS, SAMPLES = 16, 16, 4, 128, 24, 512, 8
CASES = ((64, 256), (64, 64), (1024, 64), (1024, 512))  # (prompt, output tokens so far)


def table_of(prompt: int, length: int, layout: str) -> tuple[torch.Tensor, int]:
    """Each row's pages (page 0 is the trash page) and the pages in use."""
    pages_row, prompt_pages = -(-length // PAGE), prompt // PAGE
    groups = ROWS // SAMPLES
    if layout == "distinct":
        return torch.arange(ROWS * pages_row).view(ROWS, pages_row) + 1, ROWS * pages_row
    own = pages_row - prompt_pages
    shared = torch.arange(groups * prompt_pages).view(groups, prompt_pages).repeat_interleave(SAMPLES, 0)
    mine = groups * prompt_pages + torch.arange(ROWS * own).view(ROWS, own)
    table = torch.cat([shared, mine], 1) + 1
    if layout == "scattered":
        table = table[torch.randperm(ROWS)]
    return table, groups * prompt_pages + ROWS * own


def run(prompt: int, out: int, layout: str, dev: torch.device) -> None:
    length = prompt + out
    table, pages = table_of(prompt, length, layout)
    prefix = None
    if layout == "prefix":
        prefix = torch.tensor(prefix_groups(table.tolist(), [length] * ROWS, PAGE, MAX_MEMBERS), device=dev)
    table = table.to(dev)
    slots = (pages + 1) * PAGE
    pools = [
        tuple(torch.randn(slots, KV_HEADS, DIM, device=dev, dtype=torch.bfloat16) for _ in range(2))
        for _ in range(LAYERS)
    ]
    lens = torch.full((ROWS,), length, device=dev)
    q = torch.randn(ROWS, HEADS, DIM, device=dev, dtype=torch.bfloat16)
    plain = decode_attention(q, *pools[0], table, lens, PAGE, DIM**-0.5)
    err = (plain.float() - decode_attention(q, *pools[0], table, lens, PAGE, DIM**-0.5, prefix=prefix).float()).abs()

    def step():
        for k, v in pools:
            decode_attention(q, k, v, table, lens, PAGE, DIM**-0.5, prefix=prefix)

    for _ in range(3):
        step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    ms = start.elapsed_time(end) / 20
    read = ROWS * length * KV_HEADS * DIM * 2 * 2 * LAYERS  # K and V of every row's keys, bf16
    distinct = pages * PAGE * KV_HEADS * DIM * 2 * 2 * LAYERS
    print(
        f"| {prompt} + {out} | {layout} | {ms:.3f} | {read / ms / 1e9:.2f} | {distinct / ms / 1e9:.2f} "
        f"| {err.max().item():.1e} |",
        flush=True,
    )


def main() -> None:
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(dev))
    print("| prompt + output | layout | ms a step | TB/s, rows' keys | TB/s, distinct pages | prefix - plain |")
    print("|---|---|---|---|---|---|")
    for prompt, out in CASES:
        for layout in ("distinct", "shared", "scattered", "prefix"):
            run(prompt, out, layout, dev)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
