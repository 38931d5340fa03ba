"""CUDA graphs of small prefill steps: a prefill of a few thousand tokens is one launch instead of the
~1,700 eager kernels of a 24-layer forward, whose launches, not the device, set its time (on an H100
a 64-token prefill of 16 prompts took 43 ms eagerly, and one of 64 prompts 48 ms: the device's part of
the first is a few ms). Small prefills are what an agent's turns (a tool's answer fed to a few
episodes) and a GRPO step's arrival wave of short prompts send.

The padded layout: a graph of (rows bucket R, longest bucket L, table width W) feeds R x L tokens, row
r's tokens at r * L.. (the layout the attention pads a prefill to anyway, kv/attention.py), so nothing
in it depends on the rows' lengths but the values of its static inputs: a row's unused places feed
token 0 at position 0 into the trash page's first slot, and the unused rows the same over a table of
trash pages (as a decode graph's padded rows do). It returns the logits of each row's last fed token,
so it serves steps that want no more than those (not a prompt's input logprobs, not routes, not riders).

All of a graph's inputs live in one int64 buffer on the device (`padded_host` builds it on the host,
`padded_views` cuts it into ids, positions, slots, key counts, logits rows and block table), filled by
one copy from pinned memory queued behind the device's work. A shape is captured the second time a
step needs it (once, it may never come again: its step runs eagerly), into the decode graphs' pool
and memory-saver region (kv/graphs.py: paused, resumed and dropped with them), at most
`MAX_PREFILL_GRAPHS` of them.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from rollfleet.engine.kv.attention import PagedInputs
from rollfleet.engine.kv.blocks import TRASH_PAGE
from rollfleet.engine.kv.graphs import DecodeGraphs, width_bucket

log = logging.getLogger("rollfleet.engine")

PREFILL_GRAPH_TOKENS = 4096  # R x L of the largest graph: past it the device's work dwarfs the launches
MAX_PREFILL_GRAPHS = 48
SMALLEST_LONGEST = 16

Shape = tuple[int, int, int]  # (rows R, longest L, table width W)


def padded_shape(rows, buckets: list[int]) -> Shape | None:
    """The graph shape a prefill step of `rows` ((start, tokens, pages) each) replays: R the batch
    bucket of its rows, L the power of two (at least 16) of its longest row, W its table's width
    bucket; None when it has more rows than the largest bucket or R x L is past PREFILL_GRAPH_TOKENS."""
    if not buckets or len(rows) > buckets[-1]:
        return None
    count = next(b for b in buckets if b >= len(rows))
    longest = max(SMALLEST_LONGEST, 1 << (max(len(tokens) for _, tokens, _ in rows) - 1).bit_length())
    if count * longest > PREFILL_GRAPH_TOKENS:
        return None
    return count, longest, width_bucket(max(len(pages) for _, _, pages in rows))


def last_token_rows(rows, logits_at: list[int]) -> list[int] | None:
    """Which row's last fed token each of `logits_at` (packed positions) is; None when one is not a
    row's last token (a prompt's input logprobs want more: its step runs eagerly)."""
    ends, packed = {}, 0
    for row, (_, tokens, _) in enumerate(rows):
        packed += len(tokens)
        ends[packed - 1] = row
    picked = [ends.get(at) for at in logits_at]
    return None if None in picked else picked


def padded_host(rows, shape: Shape, page_size: int, pin: bool = False) -> torch.Tensor:
    """The step's inputs in the padded layout, as one int64 tensor on the host (`padded_views`)."""
    count, longest, width = shape
    trash_slot = TRASH_PAGE * page_size
    ids, positions, slots, lens, keep, table = [], [], [], [], [], []
    for row, (start, tokens, pages) in enumerate(rows):
        pad = longest - len(tokens)
        fed = range(start, start + len(tokens))
        ids += [*tokens, *[0] * pad]
        positions += [*fed, *[0] * pad]
        slots += [pages[pos // page_size] * page_size + pos % page_size for pos in fed] + [trash_slot] * pad
        lens.append(start + len(tokens))
        keep.append(row * longest + len(tokens) - 1)
        table += [*pages, *[TRASH_PAGE] * (width - len(pages))]
    for row in range(len(rows), count):  # padded rows: one token at position 0 over the trash page
        ids += [0] * longest
        positions += [0] * longest
        slots += [trash_slot] * longest
        lens.append(1)
        keep.append(row * longest)
        table += [TRASH_PAGE] * width
    values = ids + positions + slots + lens + keep + table
    return torch.tensor(values, dtype=torch.long, pin_memory=pin)


def padded_views(flat: torch.Tensor, shape: Shape) -> tuple[torch.Tensor, ...]:
    """(ids [1, R*L], positions [1, R*L], slots [R*L], lens [R], keep [R], table [R, W]) of `flat`."""
    count, longest, width = shape
    tokens = count * longest
    ids, positions, slots, lens, keep, table = flat.split([tokens, tokens, tokens, count, count, count * width])
    return ids[None], positions[None], slots, lens, keep, table.view(count, width)


def padded_inputs(flat: torch.Tensor, shape: Shape, pool) -> tuple:
    """(ids, positions, PagedInputs, keep) of the padded layout over `flat`, the forward's arguments."""
    ids, positions, slots, lens, keep, table = padded_views(flat, shape)
    count, longest, _ = shape
    inputs = PagedInputs(pool.keys, pool.values, pool.page_size, slots=slots, table=table, lens=lens, decode=False)
    inputs.q_pos = positions.view(count, longest)  # q_index None: the tokens are in the padded layout already
    return ids, positions, inputs, keep


@dataclass
class PrefillGraph:
    graph: torch.cuda.CUDAGraph
    flat: torch.Tensor  # every static input (padded_views)
    logits: torch.Tensor  # [R, vocab]: each row's last token's


class PrefillGraphs:
    """The prefill graphs of one engine, beside its decode graphs (their pool, saver and switches)."""

    def __init__(self, decode: DecodeGraphs):
        self.decode = decode
        self.graphs: dict[Shape, PrefillGraph] = {}
        self.seen: set[Shape] = set()
        self.captures, self.capture_s, self.replays = 0, 0.0, 0
        self.disabled: str | None = None
        decode.prefill = self  # its drop() forgets these too

    def run(self, rows, logits_at: list[int]) -> torch.Tensor | None:
        """The logits at `logits_at` of a prefill step of `rows`, or None: run it eagerly (a shape too
        large, seen once, or past the graphs' number; logits besides the rows' last; graphs off)."""
        decode = self.decode
        if self.disabled is not None or decode.disabled is not None or decode.paused:
            return None
        shape = padded_shape(rows, decode.buckets)
        picked = last_token_rows(rows, logits_at) if shape is not None else None
        if picked is None:
            return None
        graph = self.graphs.get(shape)
        if graph is None:
            if shape not in self.seen or len(self.graphs) >= MAX_PREFILL_GRAPHS:
                self.seen.add(shape)
                return None
            try:
                graph = self.graphs[shape] = self._capture(shape)
            except Exception as exc:  # noqa: BLE001 - any capture failure means: run prefills eagerly
                self.disabled = f"capture failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                log.warning("prefill CUDA graphs off for this engine, prefills run eagerly (%s)", self.disabled)
                return None
        graph.flat.copy_(padded_host(rows, shape, decode.kv.page_size, pin=True), non_blocking=True)
        graph.graph.replay()
        self.replays += 1
        if picked == list(range(len(picked))):
            return graph.logits[: len(picked)]
        return graph.logits[torch.tensor(picked, device=graph.logits.device)]

    def _capture(self, shape: Shape) -> PrefillGraph:
        start, decode = time.perf_counter(), self.decode
        count, _, width = shape
        rows = [(0, [0], [TRASH_PAGE] * width)] * count  # any valid layout: replays refill every input
        flat = padded_host(rows, shape, decode.kv.page_size).to(decode.device)
        graph, logits = decode.capture_forward(*padded_inputs(flat, shape, decode.kv))
        self.captures += 1
        self.capture_s += time.perf_counter() - start
        return PrefillGraph(graph, flat, logits)

    def drop(self) -> None:
        self.graphs.clear()
