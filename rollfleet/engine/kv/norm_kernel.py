"""transformers' RMSNorm modules in one Triton kernel each, on the paged fast path's GPUs.

A Qwen3 layer has four RMSNorms (input, post-attention, q and k norms); transformers runs each as
eight small kernels (cast, square, mean, add, rsqrt, multiply, cast, scale), about 700 launches a
decode step of a 24-layer model that a CUDA graph still replays one by one. `fuse_rms_norms`
replaces the forward of every module that has RMSNorm's shape (a `weight` of the last dimension
and a `variance_epsilon`) with one program per row that does the same arithmetic in the same order:
normalise in float32, round to the input's dtype, scale by the weight in the output's dtype.
Weight updates write into the same `weight` (read at every call), so graphs stay valid.
"""

from __future__ import annotations

import logging
import types

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU builds of torch come without Triton: transformers' own modules serve
    triton = None

log = logging.getLogger("rollfleet.engine")


def fusable(module: torch.nn.Module) -> bool:
    """An RMSNorm as transformers writes it (Qwen, Llama, Mistral): a plain weight, an epsilon."""
    weight = getattr(module, "weight", None)
    return (
        type(module).__name__.endswith("RMSNorm")
        and hasattr(module, "variance_epsilon")
        and type(weight) is torch.nn.Parameter  # not a DTensor (a tp plan's): the kernel takes local tensors
        and weight.dim() == 1
    )


def fuse_rms_norms(model: torch.nn.Module) -> int:
    """Give every fusable RMSNorm of `model` the one-kernel forward; how many were given it."""
    count = 0
    for module in model.modules():
        if fusable(module):
            module.forward = types.MethodType(_forward, module)
            count += 1
    log.warning("RMSNorm fused into one kernel in %d modules", count)  # once a start, beside the pool's line
    return count


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`weight * (x * rsqrt(mean(x**2) + eps)).to(x.dtype)` with the mean in float32, as transformers."""
    shape, width = x.shape, x.shape[-1]
    rows = x.reshape(-1, width)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    _norm_kernel[(rows.shape[0],)](rows, weight, out, rows.stride(0), width, eps, BLOCK=triton.next_power_of_2(width))
    return out.view(shape)


def _forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    return rms_norm(hidden_states, self.weight, self.variance_epsilon)


if triton is not None:

    @triton.jit
    def _norm_kernel(x_ptr, w_ptr, out_ptr, row_stride, width, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        live = cols < width
        x = tl.load(x_ptr + row.to(tl.int64) * row_stride + cols, mask=live, other=0.0)
        xf = x.to(tl.float32)
        variance = tl.sum(xf * xf, 0) / width
        normed = (xf * tl.rsqrt(variance + eps)).to(x.dtype)  # rounded to the input's dtype first
        weight = tl.load(w_ptr + cols, mask=live, other=0.0)  # the product in float32, rounded once to
        out = (weight.to(tl.float32) * normed.to(tl.float32)).to(out_ptr.dtype.element_ty)  # torch's promotion
        tl.store(out_ptr + row.to(tl.int64) * width + cols, out, mask=live)
