"""The paged KV pool's flags (SGLang's names and meanings) and its start on a serving engine: the
pool's size, the default `--max-running-requests` from it, the pool allocated on every tp rank
(a lockstep action), and the scheduler's `PagedBatches` over its pages."""

from __future__ import annotations

import argparse
import functools
import logging

from rollfleet.engine.kv.blocks import BlockPool
from rollfleet.engine.kv.capacity import (
    CPU_MAX_RUNNING_REQUESTS,
    DEFAULT_GPU_FRACTION,
    GPU_MAX_RUNNING_REQUESTS,
    activation_reserve_bytes,
)
from rollfleet.engine.kv.pool import DEFAULT_PAGE_SIZE, pool_tokens
from rollfleet.engine.kv.prefix_groups import MIN_SHARED_KEYS
from rollfleet.engine.kv.steps import PagedBatches
from rollfleet.engine.tp.lockstep import Action

log = logging.getLogger("rollfleet.engine")
DEFAULT_CHUNKED_PREFILL = 8192
DEFAULT_GRAPH_MAX_BATCH = 512


def add_kv_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--rollfleet-kv-cache",
        choices=["paged", "dense"],
        default="paged",
        help="paged: one preallocated pool of pages, continuous batching, prefix sharing, CUDA graphs "
        "(models with full attention of the Qwen/Llama families); dense: transformers' own cache, a "
        "batch left-padded and re-prefilled when it changes (any model; others fall back to it)",
    )
    p.add_argument("--page-size", type=int, default=DEFAULT_PAGE_SIZE, help="tokens per KV page")
    p.add_argument("--max-total-tokens", type=int, default=None, help="KV pool size in tokens (default: from memory)")
    p.add_argument(
        "--chunked-prefill-size",
        type=int,
        default=DEFAULT_CHUNKED_PREFILL,
        help="most prompt tokens one prefill step takes (longer prompts go in chunks); -1: no limit",
    )
    p.add_argument("--disable-radix-cache", action="store_true", help="no prefix cache across requests")
    _add_graph_flags(p)
    p.add_argument(
        "--disable-overlap-schedule",
        action="store_true",
        help="a decode step waits for its tokens to reach the host before the next is launched (default: "
        "the next step runs on the device while the host records the last one, at tp 1; kv/overlap.py)",
    )
    p.add_argument(
        "--enable-mixed-chunk",
        action="store_true",
        help="decode rows ride along a prefill step (its chunks and new prompts) instead of waiting for it, in "
        "one eager forward, their attention in the decode layout (default, as SGLang's: a prefill step feeds "
        "prompts only, and decode steps replay CUDA graphs)",
    )
    p.add_argument(
        "--rollfleet-memory-saver",
        choices=["auto", "on", "off"],
        default="auto",
        help="the KV pool and decode graphs in torch_memory_saver's pausable memory, so that a release and "
        "resume of kv_cache and cuda_graph keep their addresses (no recapture): auto uses it on a GPU where it "
        "is installed (pip install 'rollfleet[gpu]'), on requires it; decided at start, see /get_server_info",
    )
    p.add_argument(
        "--rollfleet-shared-prefix-keys",
        type=int,
        default=MIN_SHARED_KEYS,
        help="decode rows that share at least this many keys of leading pages (a request's samples over its "
        "prompt) read them once, together (the decode kernel's prefix pass, kv/prefix_groups.py); 0: never",
    )
    p.add_argument(
        "--attention-backend",
        default=None,
        help="triton (the default on a GPU with Triton): decode attention reads the pages in place and each "
        "RMSNorm is one kernel; torch_native (the CPU's): pages gathered, then SDPA, transformers' own "
        "modules; SGLang's other names (flashinfer, fa3, ...) are accepted and served by triton where it runs",
    )


def _add_graph_flags(p: argparse.ArgumentParser) -> None:
    """SGLang's CUDA graph flags (decode and prefill)."""
    for flag in ("--cuda-graph-max-bs-decode", "--cuda-graph-max-bs"):
        p.add_argument(flag, type=int, help=f"largest decode batch a CUDA graph covers ({DEFAULT_GRAPH_MAX_BATCH})")
    p.add_argument("--disable-decode-cuda-graph", action="store_true", help="decode steps run eagerly")
    p.add_argument(
        "--disable-prefill-cuda-graph",
        action="store_true",
        help="prefill steps run eagerly (default: small ones replay CUDA graphs, kv/prefill_graphs.py)",
    )
    p.add_argument("--disable-cuda-graph", action="store_true", help="decode and prefill steps run eagerly")


def check_kv_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.page_size < 1:
        parser.error(f"--page-size {args.page_size}: must be >= 1 (16 is a good size)")
    if args.max_total_tokens is not None and args.max_total_tokens < 2 * args.page_size:
        parser.error(f"--max-total-tokens {args.max_total_tokens}: must hold at least two pages of --page-size")
    if args.rollfleet_shared_prefix_keys < 0:
        keys = args.rollfleet_shared_prefix_keys
        parser.error(f"--rollfleet-shared-prefix-keys {keys}: give a number of keys >= 0 (0: never)")
    if args.chunked_prefill_size == 0 or args.chunked_prefill_size < -1:
        parser.error(f"--chunked-prefill-size {args.chunked_prefill_size}: give a number of tokens, or -1 for no limit")


def paged_options(args: argparse.Namespace) -> dict | None:
    """ModelRunner's `paged` argument: None for the dense cache."""
    if args.rollfleet_kv_cache != "paged":
        return None
    return {
        "page_size": args.page_size,
        "graphs": not (args.disable_decode_cuda_graph or args.disable_cuda_graph),
        "prefill_graphs": not (args.disable_prefill_cuda_graph or args.disable_cuda_graph),
        "kernel": args.attention_backend != "torch_native",  # where Triton runs (kv/decode_kernel.py)
        "memory_saver": args.rollfleet_memory_saver == "on",  # resolved at start (kv/saver.py)
        "shared_prefix_keys": args.rollfleet_shared_prefix_keys,
    }


def start_paged(args: argparse.Namespace, runner, lockstep, context_length: int):
    """Size and allocate the pool (every rank), set `args.max_running_requests` when not given and
    `args.max_total_tokens` to the pool's size; the scheduler's batches (None: the dense cache)."""
    paged = runner.paged
    # as SGLang resolves it, /get_server_info says whether decode steps overlap: only on the paged
    # pool at tp 1 (the followers would need the draws, kv/overlap.py)
    args.disable_overlap_schedule = args.disable_overlap_schedule or paged is None or args.tp_size > 1
    if paged is None:
        return None
    on_gpu = runner.device.type == "cuda"
    vocab = runner.model.config.get_text_config().vocab_size
    largest = args.max_running_requests or (GPU_MAX_RUNNING_REQUESTS if on_gpu else CPU_MAX_RUNNING_REQUESTS)
    tokens = pool_tokens(
        paged.shape,
        runner.device,
        max_total_tokens=args.max_total_tokens,
        mem_fraction=args.mem_fraction_static or DEFAULT_GPU_FRACTION,
        max_running=largest,
        context_length=context_length,
        reserve_bytes=activation_reserve_bytes(largest, vocab) + runner.lora.merge_bytes(),  # merges' saved base
    )
    if args.max_running_requests is None:  # SGLang 0.5.23's estimate from the pool (capacity.py)
        estimate = min(max(tokens * 512 // context_length, 2048), 4096) if on_gpu else CPU_MAX_RUNNING_REQUESTS
        args.max_running_requests = max(min(estimate, tokens // 2), 1)
    num_pages = tokens // args.page_size + 1  # + the trash page
    args.max_total_tokens = (num_pages - 1) * args.page_size
    graph_batch = args.cuda_graph_max_bs_decode or args.cuda_graph_max_bs or DEFAULT_GRAPH_MAX_BATCH
    lockstep(Action.ALLOCATE_KV, num_pages=num_pages, max_graph_batch=min(graph_batch, args.max_running_requests))
    log.warning(
        "paged KV pool: %d tokens in pages of %d (%.2f GiB per rank), up to %d running requests",
        args.max_total_tokens,
        args.page_size,
        args.max_total_tokens * paged.shape.bytes_per_token / 2**30,
        args.max_running_requests,
    )
    chunk = None if args.chunked_prefill_size == -1 else args.chunked_prefill_size
    blocks = BlockPool(num_pages, args.page_size, prefix_cache=not args.disable_radix_cache)
    return functools.partial(
        PagedBatches,
        blocks,
        kv_epoch=lambda: paged.epoch,
        weights_generation=lambda: runner.weights.generation,
        adapter_identity=runner.lora.identity,
        chunk_tokens=chunk,
        overlap=not args.disable_overlap_schedule,
        mixed=args.enable_mixed_chunk,
    )
