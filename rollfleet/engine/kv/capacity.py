"""How many requests one batch may hold when `--max-running-requests` is not given.

On a GPU, as SGLang sizes it (0.5.23, `pool_configurator._resolve_max_running_requests_per_worker`):
the tokens of KV cache that fit in this rank's share of the device (`--mem-fraction-static` of it,
0.85 when unset, minus what the loaded weights take), then 512 requests per context length's worth
of those tokens, kept within [2048, 4096] and at most half the tokens. A GRPO step's samples
(prompts x n) then run as one batch instead of waves of 64. The embedded engine has no fixed pool:
the figure bounds the batch, the KV cache grows with it. On the CPU: 64, as before.
"""

from __future__ import annotations

import torch

from rollfleet.engine.kv.pool import KVShape

CPU_MAX_RUNNING_REQUESTS = 64
GPU_MAX_RUNNING_REQUESTS = 4096  # the largest batch a GPU engine plans for when not told
DEFAULT_GPU_FRACTION = 0.85


def activation_reserve_bytes(max_running: int, vocab: int) -> int:
    """What the paged pool leaves inside `--mem-fraction-static` for a step's transient tensors: the
    logits of a full batch and the sampler's two copies of them (fp32), plus 2 GiB of activations
    (the memory plan counts the same figure, rollfleet.fleet.memory_plan)."""
    return 3 * max_running * vocab * 4 + 2 * 2**30


def kv_bytes_per_token(config, dtype: torch.dtype, tp_size: int) -> int:
    """KV cache bytes of one token on one tp rank (keys and values of every attention layer)."""
    return KVShape.of(config, dtype, tp_size).bytes_per_token


def max_running_requests(args, runner, context_length: int) -> int:
    """`args.max_running_requests`, or the figure the module docstring gives for `runner`'s device."""
    if args.max_running_requests is not None:
        return args.max_running_requests
    device = runner.device
    if device.type != "cuda":
        return CPU_MAX_RUNNING_REQUESTS
    _, total = torch.cuda.mem_get_info(device)
    available = total * (args.mem_fraction_static or DEFAULT_GPU_FRACTION) - torch.cuda.memory_allocated(device)
    tokens = max(int(available // kv_bytes_per_token(runner.model.config, runner.dtype, args.tp_size)), 2)
    estimated = min(max(tokens * 512 // context_length, 2048), 4096)
    return min(estimated, tokens // 2)
