"""CUDA graphs of the decode step, one per (batch-size bucket, block-table width bucket), captured
the first time a step needs one, into one memory pool, and replayed with the step's inputs copied
into the graph's static buffers: a decode step is one launch instead of hundreds of eager kernels.

Buckets: batch sizes 1, 2, 4, 8, then steps of 16 up to `max_batch` (SGLang's
`--cuda-graph-max-bs-decode`); block-table widths by `width_bucket`, and a step replays the
narrowest graph of its batch bucket that is wide enough (a capture costs a fraction of a second,
and a run's batches grow, shrink and widen through many shapes). Padded rows write to the trash
page and attend to its first slot only. Graphs stay valid across in-place weight updates and LoRA
merges (same addresses); a release or resume of weights moves memory, and `drop` forgets them
(recaptured on demand). A model whose forward cannot be captured (a host sync, e.g. MoE experts
routed with `.nonzero()`) runs eagerly, said once in the log.

The `cuda_graph` memory tag: with the memory saver (kv/saver.py) captures allocate inside its
`cuda_graph` region, so a release pauses the graphs' memory (intermediates and outputs) and a
resume maps it again at the same addresses: the graphs are kept, nothing is captured again. Their
contents after a resume are arbitrary, which is harmless: every replay writes each intermediate
before reading it (the static inputs a replay reads live outside the region, refilled by `_fill`).
While paused no step replays (it would touch unmapped memory): decode runs eagerly. Without the
saver a release of the tag drops the graphs, as a release of weights does.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from rollfleet.engine.kv.attention import PagedInputs
from rollfleet.engine.kv.prefix_groups import MIN_SHARED_KEYS, PrefixGroups
from rollfleet.engine.kv.saver import CUDA_GRAPH_TAG, PausableMemory
from rollfleet.engine.kv.tables import TableMirror, step_inputs

log = logging.getLogger("rollfleet.engine")


def batch_buckets(max_batch: int) -> list[int]:
    small = [b for b in (1, 2, 4, 8) if b < max_batch]
    return [*small, *range(16, max_batch, 16), max_batch] if max_batch > 8 else [*small, max_batch]


def width_bucket(pages: int, coarse: bool = False) -> int:
    """The block-table width a graph covers for rows of up to `pages` pages. `coarse` (the decode
    kernel reads each row's own pages, so padding costs the GPU nothing): powers of two from 8 up to
    64 pages. Otherwise, and past 64 (the gather path copies every padded page, and the host builds
    the table every step): multiples of 4 pages up to 32, then of an eighth of the power of two
    above (at most 1/8 padding past 32 pages)."""
    if coarse and pages <= 64:
        return max(8, 1 << max(pages - 1, 1).bit_length())
    step = max(4, 1 << max(max(pages - 1, 1).bit_length() - 3, 0))
    return -(-pages // step) * step


def graph_width(captured: list[int], pages: int, coarse: bool) -> int:
    """The table width a step of rows of up to `pages` pages replays: the narrowest of its batch
    bucket's `captured` widths that holds them (a wider table serves narrower rows), else a new one."""
    wide_enough = [width for width in captured if width >= pages]
    return min(wide_enough) if wide_enough else width_bucket(pages, coarse)


@dataclass
class Graph:
    graph: torch.cuda.CUDAGraph
    ids: torch.Tensor  # [1, batch]
    positions: torch.Tensor
    inputs: PagedInputs
    keep: torch.Tensor  # every static input the graph reads stays alive with it: a freed one is reused
    logits: torch.Tensor  # [batch, vocab]
    table: TableMirror  # its block table on the host (pinned), written where it changed (kv/tables.py)
    copied: torch.cuda.Event  # recorded after each copy of `table` to the device (the host waits on it)


class DecodeGraphs:  # graphs by (batch bucket, width, with the prefix pass)
    def __init__(
        self,
        forward: Callable[..., torch.Tensor],
        device: torch.device,
        kernel: bool = False,
        saver: PausableMemory | None = None,
        shared_prefix_keys: int = MIN_SHARED_KEYS,
    ):
        self.forward, self.device, self.kernel, self.saver = forward, device, kernel, saver
        self.shared_prefix_keys = shared_prefix_keys  # 0: no prefix pass
        self.paused = False  # the cuda_graph tag is released (saver only): no replay until resumed
        self.graphs: dict[tuple[int, int], Graph] = {}
        self.disabled: str | None = None
        self.pool = None
        self.buckets: list[int] = []
        self.captures, self.capture_s = 0, 0.0  # since start, for the benchmarks
        self.prefill = None  # the prefill graphs beside these (kv/prefill_graphs.py), dropped with them
        self.groups: PrefixGroups | None = None  # rows sharing leading pages (the decode kernel's prefix pass)

    def configure(self, pool, max_batch: int) -> None:
        self.kv, self.buckets = pool, batch_buckets(max_batch) if max_batch > 0 else []
        if self.kernel and self.shared_prefix_keys > 0:
            self.groups = PrefixGroups(pool.page_size, pin=True, min_keys=self.shared_prefix_keys)
        if not self.buckets:
            self.disabled = "CUDA graphs are off (--disable-cuda-graph or a max batch of 0)"

    def usable(self, batch: int) -> bool:
        return self.disabled is None and not self.paused and bool(self.buckets) and batch <= self.buckets[-1]

    def run(self, rows, ids: torch.Tensor | None = None) -> torch.Tensor | None:
        """The logits of `rows` (a decode step; `ids`: their fed tokens on the device, else the rows'),
        or None when this model cannot be captured: run it eagerly."""
        batch = next(b for b in self.buckets if b >= len(rows))
        need = max(len(pages) for _, _, pages in rows)
        groups = self.groups.of(rows, batch) if self.groups is not None else None
        graph, width, shared = self._captured(batch, need, groups is not None)
        if graph is None:
            try:
                graph = self._capture(batch, width, shared)
            except Exception as exc:  # noqa: BLE001 - any capture failure means: run this model eagerly
                self.disabled = f"capture failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                log.warning("CUDA graphs off for this engine, decode runs eagerly (%s)", self.disabled)
                return None
            self.graphs[(batch, width, shared)] = graph
        self._fill(graph, rows, ids, groups)
        graph.graph.replay()
        return graph.logits[: len(rows)]

    def _captured(self, batch: int, need: int, grouped: bool) -> tuple[Graph | None, int, bool]:
        """(the graph a step replays, or None: capture it; its width; with the prefix pass). A step with
        groups needs the pass; one without replays a graph with it where that is what was captured (its
        groups all zero: the pass writes nothing), rather than capture another (the tail of a GRPO wave,
        whose last groups have run out: a capture costs more than a few steps' idle pass)."""
        widths = [w for b, w, s in self.graphs if b == batch and (s or not grouped)]
        width = graph_width(widths, need, coarse=self.kernel)
        for shared in (False, True) if not grouped else (True,):
            if (batch, width, shared) in self.graphs:
                return self.graphs[(batch, width, shared)], width, shared
        return None, width, grouped

    def _fill(self, graph: Graph, rows, ids: torch.Tensor | None, groups: torch.Tensor | None) -> None:
        """The step's inputs into the graph's static buffers, queued behind the device's work (from
        pinned memory: nothing here waits for the step before, which may still run, kv/overlap.py)."""
        graph.copied.synchronize()  # the last step's copy has left the host table (normally long ago)
        host, table = step_inputs(rows, self.kv.page_size, graph.table, fed=ids is None)
        graph.ids.copy_(host[0:1], non_blocking=True), graph.positions.copy_(host[1:2], non_blocking=True)
        graph.inputs.slots.copy_(host[2], non_blocking=True), graph.inputs.lens.copy_(host[3], non_blocking=True)
        if ids is not None:
            graph.ids[0, : len(rows)].copy_(ids)
        graph.inputs.table.copy_(table, non_blocking=True)
        if groups is not None:
            graph.inputs.prefix.copy_(groups, non_blocking=True)
        elif graph.inputs.prefix is not None:  # a graph with the pass, for a step without groups
            graph.inputs.prefix.zero_()
        graph.copied.record()

    def _capture(self, batch: int, width: int, shared: bool) -> Graph:
        start = time.perf_counter()
        dev = self.device
        zeros = torch.zeros(batch, dtype=torch.long, device=dev)
        inputs = PagedInputs(
            self.kv.keys,
            self.kv.values,
            self.kv.page_size,
            slots=zeros.clone(),
            table=torch.zeros(batch, width, dtype=torch.long, device=dev),
            lens=torch.ones(batch, dtype=torch.long, device=dev),
            decode=True,
            kernel=self.kernel,
            prefix=torch.zeros(2, batch, dtype=torch.long, device=dev) if shared else None,
        )
        ids, positions = zeros.clone()[None], zeros.clone()[None]
        keep = torch.arange(batch, device=dev)
        graph, logits = self.capture_forward(ids, positions, inputs, keep)
        self.captures += 1
        self.capture_s += time.perf_counter() - start
        table = TableMirror(batch, width, pin=True)
        return Graph(graph, ids, positions, inputs, keep, logits, table, torch.cuda.Event())

    def capture_forward(self, ids, positions, inputs: PagedInputs, keep) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """A graph of the forward over these static inputs, and its logits: one warm-up on a side stream
        (lazy inits happen outside the capture), then the capture into the shared pool, inside the
        saver's cuda_graph region (it routes this thread's allocations, the capture's included)."""
        dev = self.device
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            self.forward(ids, positions, inputs, keep)
        torch.cuda.current_stream(dev).wait_stream(side)
        inputs.forget_masks()  # built again inside the capture, from the static buffers
        graph = torch.cuda.CUDAGraph()
        region = self.saver.region(CUDA_GRAPH_TAG) if self.saver is not None else contextlib.nullcontext()
        with region, torch.cuda.graph(graph, pool=self.pool):
            logits = self.forward(ids, positions, inputs, keep)
        return graph, logits

    def drop(self) -> None:
        self.graphs.clear()
        self.pool = None
        if self.prefill is not None:
            self.prefill.drop()

    def pause(self) -> None:
        """Release the cuda_graph tag: with the saver its memory is unmapped and the graphs kept;
        without it they go (their memory returns to the allocator)."""
        if self.saver is None:
            return self.drop()
        if not self.paused:
            self.saver.pause(CUDA_GRAPH_TAG, self.device)
            self.paused = True

    def resume(self) -> None:
        if self.paused:
            self.saver.resume(CUDA_GRAPH_TAG)
            self.paused = False
