"""The paged decode kernel alone (engine/kv/decode_kernel.py) on one GPU, over its block size,
warps, stages and target program count: batch 512 (and 1) x 321 tokens of KV in pages of 16, 16
query heads over 4 KV heads, head_dim 128, bf16; microseconds per call (Triton's Python launch
included: inside a CUDA graph it goes) and the KV bytes read per second.

    python scripts/gpu_sweep_decode_kernel.py
"""

from __future__ import annotations

import itertools
import sys
import time

import torch

sys.path.insert(0, ".")

from rollfleet.engine.kv import decode_kernel  # noqa: E402

ROWS, HEADS, KV_HEADS, DIM, PAGE, CONTEXT = 512, 16, 4, 128, 16, 321


def timed(fn, repeats: int = 50) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


def main() -> None:
    dev = torch.device("cuda")
    pages = -(-CONTEXT // PAGE)
    pool_k = torch.randn(ROWS * pages * PAGE + PAGE, KV_HEADS, DIM, dtype=torch.bfloat16, device=dev)
    pool_v = torch.randn_like(pool_k)
    table = (torch.randperm(ROWS * pages, device=dev) + 1).view(ROWS, pages).contiguous()
    lens = torch.full((ROWS,), CONTEXT, device=dev)
    q = torch.randn(ROWS, HEADS, DIM, dtype=torch.bfloat16, device=dev)
    kv_bytes = ROWS * CONTEXT * KV_HEADS * DIM * 2 * 2
    scale = DIM**-0.5
    reference = decode_kernel.decode_attention(q, pool_k, pool_v, table, lens, PAGE, scale)
    for block, warps, stages in itertools.product([32, 64, 128], [2, 4, 8], [1, 2]):
        decode_kernel.BLOCK_N = block
        launch = {"num_warps": warps, "num_stages": stages}

        def call(launch=launch):
            return decode_kernel.decode_attention(q, pool_k, pool_v, table, lens, PAGE, scale, **launch)

        error = (call().float() - reference.float()).abs().max().item()
        seconds = timed(call)
        print(f"block {block} warps {warps} stages {stages}: {seconds * 1e6:.1f} us, "
              f"{kv_bytes / seconds / 1e9:.0f} GB/s, max diff {error:.3g}", flush=True)  # fmt: skip
    for block, target in itertools.product([32, 64, 128], [256, 1024]):
        decode_kernel.BLOCK_N, decode_kernel.TARGET_PROGRAMS = block, target
        seconds = timed(lambda: decode_kernel.decode_attention(q[:1], pool_k, pool_v, table[:1], lens[:1], PAGE, scale))
        print(f"batch 1, block {block}, target programs {target}: {seconds * 1e6:.1f} us", flush=True)


if __name__ == "__main__":
    main()
