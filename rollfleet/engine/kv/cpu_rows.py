"""One job: how many rows a product on this CPU needs before its rounding stops depending on them.

With one thread (a fleet engine's on a CPU), torch's CPU BLAS (MKL) computes a product over few rows
with another kernel than over many, and rounds a row's sums otherwise: a token's logits then depend on
how many rows shared its step (how requests' arrival waves split), and a seeded run does not repeat.
From some number of rows up, every row of a product rounds alike whatever the number. That number is
the CPU's, not ours: 4 on the Xeons this project first ran on (every row checked at 1-512 rows, widths
64 to 2048); on an AVX-512 + AMX Xeon (Sapphire Rapids) it grows with the product's inner width, 3 at
64, 6 at 128, 11 at 256 and 16 from 512 up (2026-12-05). So it is measured here, once per width and
thread count, over PROBE_ROWS rows, and steps are padded to it (kv/paged.py, kv/attention.py).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import torch

PROBE_ROWS = 64  # the probe compares products of 1..PROBE_ROWS rows with the first rows of the largest
FLOOR = 4  # never fewer: what the first machines needed


@functools.cache
def _alike_from(width: int, threads: int, batched: bool) -> int:
    """The fewest rows m such that a product of m' >= m rows of `width` inputs gives each row the bits
    the largest product gives it (linear: x @ W.T as nn.Linear; batched: a 5-D matmul as attention's)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(PROBE_ROWS, width, generator=gen)
    w = torch.randn(64, width, generator=gen)
    if batched:
        x, w = x.expand(2, 1, 1, *x.shape), w.expand(2, 1, 1, *w.shape).transpose(-1, -2)

        def product(m: int) -> torch.Tensor:
            return torch.matmul(x[..., :m, :], w)
    else:

        def product(m: int) -> torch.Tensor:
            return torch.nn.functional.linear(x[:m], w)

    full, least = product(PROBE_ROWS), 1
    for m in range(1, PROBE_ROWS):
        if not torch.equal(product(m), full[..., :m, :]):
            least = m + 1
    return least


def rows_alike_from(widths: Iterable[int], batched: bool = False) -> int:
    """How many rows a product of any of `widths` inner widths gets, at the current thread count, so
    that a row's result does not depend on the rows beside it: at least FLOOR."""
    threads = torch.get_num_threads()
    return max([FLOOR, *(_alike_from(int(w), threads, batched) for w in set(widths))])
