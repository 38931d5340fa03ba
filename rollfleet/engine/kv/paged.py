"""The paged forward of one step on one tp rank: a lockstep action (`Action.STEP`), so every rank
feeds the same rows in the same order.

A step names its rows: `(start, tokens, pages)` each, the tokens fed at positions start.. of a
sequence whose KV lives in `pages`, and which packed positions' logits to return. Decode steps (one
token a row) replay a CUDA graph of their batch-size bucket when graphs are on (kv/graphs.py); small
prefill steps that want only their rows' last logits replay one of the padded layout
(kv/prefill_graphs.py); every other step runs eagerly.

On CPU a step's rows are at least as many as this CPU's BLAS needs to round every row of a product
alike whatever the number of rows (kv/cpu_rows.py measures it for the model's linear widths at the
first step: 4 on some Xeons, up to 16 on others). A step of fewer tokens gets padded rows (a token at
position 0 writing to the trash page, as a graph's padded rows do) and the output head at least that
many rows, so a row's logits do not depend on how many rows share its step (how requests' arrival
waves split into steps), and a seeded run repeats to the bit on an engine of one thread (Ray gives its
workers one). With two threads it does not: the last rows of 5-7 and 9-11 differ too. Attention on the
CPU is invariant by construction (kv/attention.py, `invariant_attention`). Not on GPUs: their kernels
are chosen otherwise, and a decode step there replays a graph.
"""

from __future__ import annotations

import logging

import torch

from rollfleet.engine.kv import decode_kernel
from rollfleet.engine.kv.attention import ATTENTION_NAME, PagedInputs
from rollfleet.engine.kv.blocks import TRASH_PAGE
from rollfleet.engine.kv.cpu_rows import rows_alike_from
from rollfleet.engine.kv.fused_projections import fuse_projections
from rollfleet.engine.kv.graphs import DecodeGraphs
from rollfleet.engine.kv.norm_kernel import fuse_rms_norms
from rollfleet.engine.kv.pool import KVPool, KVShape
from rollfleet.engine.kv.prefill_graphs import PrefillGraphs
from rollfleet.engine.kv.prefix_groups import MIN_SHARED_KEYS
from rollfleet.engine.kv.qkv_kernel import FUSABLE, fuse_attention_inputs
from rollfleet.engine.kv.saver import CUDA_GRAPH_TAG, KV_CACHE_TAG, PausableMemory
from rollfleet.engine.sequences.device_copy import to_device

log = logging.getLogger("rollfleet.engine")
# model types whose attention goes through transformers' registry with full attention on every layer
PAGED_MODEL_TYPES = frozenset({"qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "llama", "mistral"})

Row = tuple[int, list[int], list[int]]  # (start position, tokens fed, the sequence's pages)


def fuse_fast_path(model, options: dict | None, device: torch.device, tp_size: int, ep_size: int) -> None:
    """Before the engine lists the parameters' storages: on the Triton path at tp 1, the projections
    that read one input become one product each (kv/fused_projections.py)."""
    kernel = options is not None and options.get("kernel", True) and decode_kernel.available(device)
    if kernel and tp_size == 1 and ep_size == 1 and paged_support(model.config) is None:
        fuse_projections(model, FUSABLE)


def paged_support(config) -> str | None:
    """Why this model cannot run on the paged pool (None: it can)."""
    text = config.get_text_config()
    if text.model_type not in PAGED_MODEL_TYPES:
        return f"model type {text.model_type!r} is not one the paged KV path was checked with"
    if getattr(text, "sliding_window", None) and getattr(text, "use_sliding_window", True):
        return "sliding-window attention"
    if any(kind != "full_attention" for kind in getattr(text, "layer_types", None) or []):
        return f"layer types {sorted(set(text.layer_types))}"
    return None


class PagedModel:
    def __init__(
        self,
        model,
        lora,
        route_capture,
        *,
        tp_size: int,
        device: torch.device,
        page_size: int,
        graphs: bool,
        prefill_graphs: bool = True,
        kernel=True,
        fuse_inputs: bool = True,
        memory_saver: bool = False,
        shared_prefix_keys: int = MIN_SHARED_KEYS,
    ):
        self.model, self.lora, self.route_capture = model, lora, route_capture
        self.device, self.page_size = device, page_size
        self.kernel = kernel and decode_kernel.available(device)  # decode reads the pages in place
        if self.kernel:  # and the RMSNorms run as one kernel each (the Triton fast path, kv/norm_kernel.py)
            fuse_rms_norms(model)
            if fuse_inputs and tp_size == 1:  # q/k norms, rotary and the K/V writes too (kv/qkv_kernel.py)
                fuse_attention_inputs(model)
        self.shape = KVShape.of(model.config, next(model.parameters()).dtype, tp_size)
        model.set_attn_implementation(ATTENTION_NAME)
        self.pool: KVPool | None = None
        # chosen once at start (kv/saver.py): the KV pool and graphs pause in place, or are freed
        self.saver = PausableMemory() if memory_saver and device.type == "cuda" else None
        on_gpu = device.type == "cuda"
        # `graphs`: decode steps replay graphs; `prefill_graphs`: small prefills do (kv/prefill_graphs.py),
        # in the decode graphs' pool and memory region (so DecodeGraphs exists for either)
        self.decode_graphs = graphs and on_gpu
        either = on_gpu and (graphs or prefill_graphs)
        self.graphs = None
        if either:  # the decode kernel's prefix pass runs inside decode graphs (kv/prefix_groups.py)
            self.graphs = DecodeGraphs(self._forward, device, self.kernel, self.saver, shared_prefix_keys)
        self.prefill_graphs = PrefillGraphs(self.graphs) if on_gpu and prefill_graphs else None
        self.last_routes: torch.Tensor | None = None
        self.cpu_rows: int | None = None  # measured at the first CPU step, on the engine's threads

    def allocate(self, num_pages: int, max_graph_batch: int) -> None:
        """The pool (a lockstep action rank 0 sends once at start, so that every rank's is alike)."""
        self.pool = KVPool(self.shape, num_pages, self.page_size, self.device, self.saver)
        if self.graphs is not None:
            self.graphs.configure(self.pool, max_graph_batch)

    @property
    def epoch(self) -> int:
        return self.pool.epoch

    @torch.inference_mode()
    def step(
        self,
        rows: list[Row],
        logits_at: list[int],
        copies: list[tuple[int, int]] = (),
        lora_name: str | None = None,
        capture_routes: bool = False,
        ids: torch.Tensor | None = None,
        riders: int = 0,
    ) -> torch.Tensor:
        """`[len(logits_at), vocab]` logits on this rank's device, of the packed positions `logits_at`.
        `ids`: a decode step's fed tokens already on the device (the last step's draws, not yet read by
        the host: kv/overlap.py); the rows' own tokens are placeholders then. `riders`: a prefill
        step's last rows that are decode rows riding along it (--enable-mixed-chunk, kv/steps.py)."""
        if self.pool.released:
            raise RuntimeError("the KV cache is released: call /resume_memory_occupation with tags ['kv_cache']")
        self.lora.use(lora_name)
        self.pool.copy_pages(list(copies))
        self.last_routes = None
        decode = ids is not None or all(len(tokens) == 1 for _, tokens, _ in rows)  # fed `ids`: a decode step
        if decode and not capture_routes and self.decode_graphs and self.graphs.usable(len(rows)):
            logits = self.graphs.run(rows, ids)
            if logits is not None:  # a decode step's logits_at is every row, in order (no copy)
                identity = len(logits_at) == len(rows) and logits_at == list(range(len(rows)))
                return logits if identity else logits[torch.tensor(logits_at, device=logits.device)]
        if not decode and not (capture_routes or riders) and self.prefill_graphs is not None:
            logits = self.prefill_graphs.run(rows, logits_at)
            if logits is not None:
                return logits
        if capture_routes:
            self.route_capture.start()
        wanted, split = len(logits_at), len(rows) - riders if riders else None
        if self.device.type == "cpu":
            if self.cpu_rows is None:
                linears = [m for m in self.model.modules() if isinstance(m, torch.nn.Linear)]
                self.cpu_rows = rows_alike_from(m.in_features for m in linears)
            rows, logits_at = cpu_padded(rows, logits_at, self.cpu_rows)
        fed, positions, inputs = self.inputs(rows, decode, split=split)
        if ids is not None:
            fed[0, : len(ids)] = ids
        keep = to_device(logits_at, torch.long, self.device)
        logits = self._forward(fed, positions, inputs, keep)[:wanted]
        if capture_routes:
            self.last_routes = self.route_capture.stop(1, fed.shape[1])[0]
        return logits

    def _forward(self, ids, positions, inputs: PagedInputs, keep) -> torch.Tensor:
        out = self.model(
            input_ids=ids,
            position_ids=positions,
            attention_mask={"full_attention": None},
            use_cache=False,
            logits_to_keep=keep,
            paged=inputs,
        )
        return out.logits[0]

    def inputs(self, rows: list[Row], decode: bool, width: int | None = None, split: int | None = None) -> tuple:
        """(ids [1, T], positions [1, T], PagedInputs) of `rows` on the device; `width` pads the
        block table (graphs use a fixed one). `split`: where a prefill step's riders begin (one-token
        rows, --enable-mixed-chunk): they attend in the decode layout (`PagedInputs.riders`), not
        padded to the step's longest row; a one-token row attends to its own position and every one
        before it, which that layout computes exactly."""
        size, dev = self.page_size, self.device
        ids = [token for _, tokens, _ in rows for token in tokens]
        positions = [pos for start, tokens, _ in rows for pos in range(start, start + len(tokens))]
        split = len(rows) if decode or split is None else split
        inputs = self._layout(rows[:split], decode, width)
        if split < len(rows):
            inputs.riders = self._layout(rows[split:], True, None)
            inputs.ride_from = sum(len(tokens) for _, tokens, _ in rows[:split])
            inputs.slots = to_device(_slots(rows, size), torch.long, dev)  # every token's K and V, written at once
        as_row = to_device([ids, positions], torch.long, dev)
        return as_row[0:1], as_row[1:2], inputs

    def _layout(self, rows: list[Row], decode: bool, width: int | None) -> PagedInputs:
        """The PagedInputs of `rows`: their slots, block table, lengths and (not decode) query layout."""
        size, dev = self.page_size, self.device
        width = width or max(len(pages) for _, _, pages in rows)
        table = [pages + [0] * (width - len(pages)) for _, _, pages in rows]
        lens = [start + len(tokens) for start, tokens, _ in rows]
        inputs = PagedInputs(
            self.pool.keys,
            self.pool.values,
            size,
            slots=to_device(_slots(rows, size), torch.long, dev),
            table=to_device(table, torch.long, dev),
            lens=to_device(lens, torch.long, dev),
            decode=decode,
            kernel=decode and self.kernel,
        )
        if not decode:
            longest = max(len(tokens) for _, tokens, _ in rows)
            q_index, q_pos = [], []
            for row, (start, tokens, _) in enumerate(rows):
                q_index += range(row * longest, row * longest + len(tokens))
                q_pos.append([*range(start, start + len(tokens)), *[0] * (longest - len(tokens))])
            inputs.q_index = to_device(q_index, torch.long, dev)
            inputs.q_pos = to_device(q_pos, torch.long, dev)
        return inputs

    # ---- memory ----------------------------------------------------------------------------
    def release(self, tags: list[str]) -> None:
        """Release the `kv_cache` and `cuda_graph` tags among `tags`. With the saver each pauses in
        place and the graphs are kept (their addresses hold); without it the pool's storages go, and
        so do the graphs (they read the pool's old addresses)."""
        if CUDA_GRAPH_TAG in tags or (KV_CACHE_TAG in tags and self.saver is None):
            if self.graphs is not None:
                self.graphs.pause()  # without the saver: dropped
        if KV_CACHE_TAG in tags:
            self.pool.release()

    def resume(self, tags: list[str]) -> None:
        """Resume `kv_cache` and `cuda_graph` among `tags`. A resume of kv_cache brings paused graphs
        back too: clients written before SGLang had the cuda_graph tag (XTuner) release all tags and
        resume only weights and kv_cache, and every decode step would then run eagerly. The record of
        released tags (runtime/memory_tags.py) keeps cuda_graph until a resume names it, as SGLang's."""
        if KV_CACHE_TAG in tags:
            self.pool.resume()
        if (CUDA_GRAPH_TAG in tags or KV_CACHE_TAG in tags) and self.graphs is not None:
            self.graphs.resume()  # a second resume does nothing

    def resume_bytes(self, tags: list[str]) -> tuple[int, int]:
        """Device memory a resume of `tags` takes: (mapped by the saver, allocated by torch's allocator)."""
        kv = KV_CACHE_TAG in tags and self.pool.released
        if self.saver is None:  # fresh storages for the pool; graphs are captured again on demand
            return 0, self.pool.full_bytes() if kv else 0
        graphs = (CUDA_GRAPH_TAG in tags or KV_CACHE_TAG in tags) and self.graphs is not None and self.graphs.paused
        paused = self.saver.paused_bytes
        return (paused.get(KV_CACHE_TAG, 0) if kv else 0) + (paused.get(CUDA_GRAPH_TAG, 0) if graphs else 0), 0

    def drop_graphs(self) -> None:
        """The weights moved (a release or resume): graphs captured on the old addresses go."""
        if self.graphs is not None:
            self.graphs.drop()


def cpu_padded(rows: list[Row], logits_at: list[int], least: int) -> tuple[list[Row], list[int]]:
    """`rows` with padded rows after them up to `least` tokens, and `logits_at` up to that many
    positions (its last repeated); the real rows' positions and logits come first, unchanged."""
    tokens = sum(len(fed) for _, fed, _ in rows)
    rows = rows + [(0, [0], [TRASH_PAGE])] * max(0, least - tokens)
    if logits_at:
        logits_at = logits_at + [logits_at[-1]] * max(0, least - len(logits_at))
    return rows, logits_at


def _slots(rows: list[Row], page_size: int) -> list[int]:
    """Where each fed token's K and V go: its position's slot in its sequence's pages."""
    return [
        pages[pos // page_size] * page_size + pos % page_size
        for start, tokens, pages in rows
        for pos in range(start, start + len(tokens))
    ]
