"""Projections that read the same input as one matrix product, on the paged fast path's GPUs.

An attention layer's q, k and v projections read the same normed hidden states, and so do an MLP's
gate and up projections: five products a layer where two do (at batch 512 the k and v products are
narrow, 1,024 columns of a 2B model, and run below the GPU's best efficiency). `fuse_projections`
puts each group's weights into one buffer, rows back to back, and points the modules' parameters
at their rows: the same Parameter objects, so weight updates, LoRA merges, fingerprints and the
release and resume of storages reach them as before. The attention forward of kv/qkv_kernel.py then
runs one product over the buffer and hands its column slices to its kernel; an MLP gets a forward
of one product and one kernel for `silu(gate) * up` (rounded as torch rounds each of the two).

It must run before the engine lists its parameters' storages (model/model.py). A group stays apart
where its modules have biases, parameters of other dtypes or devices, or not plain ones (a tp plan's).
"""

from __future__ import annotations

import logging
import os
import types

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU builds of torch come without Triton: torch's two kernels serve
    triton = None

log = logging.getLogger("rollfleet.engine")

# MLPs whose forward is down_proj(act_fn(gate_proj(x)) * up_proj(x)) (read in transformers 5.24)
GATED_MLPS = frozenset({"Qwen2MLP", "Qwen3MLP", "Qwen3MoeMLP", "Qwen2MoeMLP", "LlamaMLP", "MistralMLP"})


def fuse_projections(model: torch.nn.Module, attention_classes: frozenset[str]) -> tuple[int, int]:
    """Fuse q/k/v of every attention layer of `attention_classes` and gate/up of every SiLU-gated MLP;
    (attention layers, MLPs) fused."""
    layers = mlps = 0
    for module in model.modules():
        kind = type(module).__name__
        if kind in attention_classes and _fuse(module, ("q_proj", "k_proj", "v_proj"), "fused_qkv"):
            layers += 1
        elif kind in GATED_MLPS and _silu(module) and _fuse(module, ("gate_proj", "up_proj"), "fused_gate_up"):
            module.forward = types.MethodType(_mlp_forward, module)
            mlps += 1
    log.warning("projections fused into one product: q/k/v in %d layers, gate/up in %d MLPs", layers, mlps)
    return layers, mlps


def _silu(module: torch.nn.Module) -> bool:
    act = getattr(module, "act_fn", None)
    return type(act).__name__ == "SiLUActivation" or isinstance(act, torch.nn.SiLU)


@torch.no_grad()
def _fuse(module: torch.nn.Module, names: tuple[str, ...], attribute: str) -> bool:
    linears = [getattr(module, name, None) for name in names]
    if not all(isinstance(linear, torch.nn.Linear) and linear.bias is None for linear in linears):
        return False
    weights = [linear.weight for linear in linears]
    first = weights[0]
    alike = (first.dtype, first.device, first.shape[1])
    if not all(type(w) is torch.nn.Parameter and (w.dtype, w.device, w.shape[1]) == alike for w in weights):
        return False
    fused = torch.cat([w.detach() for w in weights])  # a buffer of its own, rows back to back
    start = 0
    for weight in weights:
        rows = weight.shape[0]
        weight.data = fused[start : start + rows]  # the same Parameter, now a view of its rows
        start += rows
    setattr(module, attribute, fused)  # a plain attribute: the parameters stay the modules' own
    setattr(module, attribute + "_sizes", [w.shape[0] for w in weights])
    return True


def _mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    return self.down_proj(silu_mul(F.linear(x, self.fused_gate_up)))


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` of `gate_up` = [..., gate | up], each op rounded to the dtype as torch's are."""
    width = gate_up.shape[-1] // 2
    if triton is None or (gate_up.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1"):
        gate, up = gate_up.split(width, dim=-1)
        return F.silu(gate) * up
    rows = gate_up.reshape(-1, 2 * width)
    out = torch.empty(rows.shape[0], width, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_mul_kernel[(rows.shape[0], triton.cdiv(width, block))](rows, out, rows.stride(0), width, BLOCK=block)
    return out.view(*gate_up.shape[:-1], width)


if triton is not None:

    @triton.jit
    def _silu_mul_kernel(x_ptr, out_ptr, row_stride, width, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        live = cols < width
        gate = tl.load(x_ptr + row * row_stride + cols, mask=live, other=0.0)
        up = tl.load(x_ptr + row * row_stride + width + cols, mask=live, other=0.0)
        g = gate.to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)  # silu, rounded to the dtype as torch's kernel
        tl.store(out_ptr + row * width + cols, (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype), mask=live)
