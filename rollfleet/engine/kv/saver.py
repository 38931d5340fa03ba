"""Pausable device memory for the KV pool and the decode graphs, through torch_memory_saver (CUDA
virtual memory, SGLang's way): a release unmaps the physical pages and keeps the virtual addresses,
a resume maps fresh pages at the same addresses. CUDA graphs captured over that memory stay valid,
so a colocated turn that keeps its weights releases and resumes its KV cache and graphs in
milliseconds, with no recapture. The contents are gone after a resume (no CPU backup: its copy is
slow, and neither the KV nor the graphs' scratch needs one; see `KVPool` for why stale KV is harmless).

The saver runs in its "torch" hook mode (a pluggable allocator behind a `torch.cuda.MemPool`), which
needs no LD_PRELOAD in the engine's process; allocations made inside `region(tag)` on the calling
thread go to the tag's pool. It refuses a process whose allocator uses expandable segments, which the
engine turns on otherwise (server.py): the choice is made once, before CUDA starts (`resolve`).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os

import torch

KV_CACHE_TAG, CUDA_GRAPH_TAG = "kv_cache", "cuda_graph"  # SGLang's tag names


def unavailable(args: argparse.Namespace) -> str | None:
    """Why this engine cannot pause its KV pool and graphs in place (None: it can)."""
    if args.device != "cuda":
        return f"--device {args.device} (the saver maps CUDA memory)"
    if args.rollfleet_kv_cache != "paged":
        return f"--rollfleet-kv-cache {args.rollfleet_kv_cache} (the saver holds the paged pool)"
    if "expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
        return "PYTORCH_CUDA_ALLOC_CONF has expandable_segments:True, which torch_memory_saver refuses"
    if importlib.util.find_spec("torch_memory_saver") is None:
        return "torch_memory_saver is not installed (pip install 'rollfleet[gpu]')"
    return None


def resolve(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str | None:
    """Turn `--rollfleet-memory-saver auto` into on or off for this process and its tp ranks (they
    get these args, and this environment); the reason it is off, if it is. `on` that cannot be
    honoured is a start error. Runs before CUDA starts: the allocator reads its settings then."""
    why_not = "--rollfleet-memory-saver off" if args.rollfleet_memory_saver == "off" else unavailable(args)
    if why_not and args.rollfleet_memory_saver == "on":
        parser.error(f"--rollfleet-memory-saver on: {why_not}; install it, or give auto or off")
    args.rollfleet_memory_saver = "off" if why_not else "on"
    if why_not:
        # Released weights must give their memory back to the device: with expandable segments the
        # caching allocator unmaps freed pages even when a segment still holds other live blocks.
        # (With the saver, which refuses them, a released weight's memory returns where its whole
        # segment is free: weights of 10 MB and more have segments of their own.)
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    return why_not


class PausableMemory:
    """The saver's regions and pause/resume, one object per tp rank. Pause and resume act on every
    allocation of the tag in this process; the caller synchronizes first (nothing may still run on
    memory that is unmapped)."""

    def __init__(self):
        from torch_memory_saver import torch_memory_saver

        torch_memory_saver.hook_mode = "torch"  # before its first use: no LD_PRELOAD needed
        self.saver = torch_memory_saver
        # the device memory each paused tag gave back, measured at its pause: what its resume maps
        # again. A map the device cannot back ends the process (the saver exits on a failed CUDA
        # call), so a resume checks it first (model.py, `resume_refusal`).
        self.paused_bytes: dict[str, int] = {}

    def region(self, tag: str) -> contextlib.AbstractContextManager:
        return self.saver.region(tag=tag)

    def pause(self, tag: str, device: torch.device) -> None:
        torch.cuda.synchronize(device)
        free = torch.cuda.mem_get_info(device)[0]
        self.saver.pause(tag)
        self.paused_bytes[tag] = max(0, torch.cuda.mem_get_info(device)[0] - free)

    def resume(self, tag: str) -> None:
        self.saver.resume(tag)
        self.paused_bytes.pop(tag, None)
