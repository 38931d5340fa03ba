"""An attention layer's inputs in one Triton kernel, on the paged fast path's GPUs.

Between its projections and its attention, a transformers attention layer (Qwen2, Qwen3, Llama,
Mistral and their MoE kin) runs the q and k RMSNorms (Qwen3), the rotary embedding
(`apply_rotary_pos_emb`: a product, a half rotation, a negation, a concatenation, a product and a sum,
for q and for k) and, in our attention function, the K and V writes into their pool slots: fourteen
launches a layer, over 300 a decode step of a 24-layer model, which a CUDA graph replays one by one.

`fuse_attention_inputs` gives each such layer a forward that does all of that in one kernel, one
program per (token, head): the norm with the norm kernel's arithmetic (kv/norm_kernel.py), the
rotation with transformers' roundings (each product rounded to the tensor's dtype, then the sum:
the same bits as `apply_rotary_pos_emb`), q into the step's query buffer, k and v into their slots.
Attention then reads the pool as before (kv/attention.py `attend`), and o_proj runs as before.
The projections stay transformers' modules, so weight updates and LoRA merges reach them as ever.

A layer gets it only where its forward is known (`FUSABLE`), its weights are plain local tensors
(tp 1), its head_dim a power of two and its norms in the activations' dtype; a step whose rotary
does not span the whole head, or whose cos/sin come in another dtype, runs transformers' forward.
"""

from __future__ import annotations

import logging
import types

import torch
import torch.nn.functional as F

from rollfleet.engine.kv.attention import attend

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU builds of torch come without Triton: transformers' forward serves
    triton = None

log = logging.getLogger("rollfleet.engine")

# attention classes whose forward is projections, optional q/k RMSNorms over head_dim, the standard
# rotary (rotate_half over the whole head), attention, o_proj (read in transformers 5.24)
# no a * b + c as one FMA: torch rounds each product and then the sum; with fusion on, the bf16
# rotary compiles to fma.rn.bf16 (sm_90 PTX) and differed from transformers' in 1 of 6 values on an H100
LAUNCH = {"enable_fp_fusion": False}
FUSABLE = frozenset(
    {"Qwen2Attention", "Qwen3Attention", "Qwen2MoeAttention", "Qwen3MoeAttention", "LlamaAttention", "MistralAttention"}
)


def fusable(module: torch.nn.Module) -> bool:
    if type(module).__name__ not in FUSABLE:
        return False
    head_dim = getattr(module, "head_dim", 0)
    weights = [p for p in module.parameters()]
    dtype = weights[0].dtype if weights else None
    return (
        head_dim >= 2
        and head_dim & (head_dim - 1) == 0  # the kernel's halves are one block each
        and all(type(p) is torch.nn.Parameter and p.dtype == dtype for p in weights)  # no DTensor (a tp plan's)
    )


def fuse_attention_inputs(model: torch.nn.Module) -> int:
    """Give every fusable attention layer of `model` the one-kernel inputs; how many were given it.
    0 where the kernel, run once on this device first, does not give torch's figures."""
    parameter = next(model.parameters())
    problem = self_check(parameter.device, parameter.dtype)
    if problem is not None:
        log.warning("attention inputs NOT fused (transformers' forward serves): %s", problem)
        return 0
    count = 0
    for module in model.modules():
        if fusable(module):
            module.forward = types.MethodType(_forward, module)
            count += 1
    log.warning("attention inputs (q/k norms, rotary, K/V writes) fused into one kernel in %d layers", count)
    return count


def _forward(self, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None, **kwargs):
    paged = kwargs.get("paged")
    cos, sin = position_embeddings if position_embeddings is not None else (None, None)
    if paged is None or cos is None or cos.shape[-1] != self.head_dim or cos.dtype != hidden_states.dtype:
        return type(self).forward(self, hidden_states, position_embeddings, attention_mask, **kwargs)
    tokens = hidden_states.shape[1]
    fused = getattr(self, "fused_qkv", None)  # one product, column slices (kv/fused_projections.py)
    if fused is not None:
        q, k, v = F.linear(hidden_states[0], fused).split(self.fused_qkv_sizes, dim=-1)
    else:
        q, k, v = self.q_proj(hidden_states[0]), self.k_proj(hidden_states[0]), self.v_proj(hidden_states[0])
    q, k, v = (t.view(tokens, -1, self.head_dim) for t in (q, k, v))
    norms = getattr(self, "q_norm", None), getattr(self, "k_norm", None)
    layer = self.layer_idx
    query = attention_inputs(q, k, v, cos[0], sin[0], norms, paged.keys[layer], paged.values[layer], paged.slots)
    out = attend(query, paged, layer, self.scaling)
    return self.o_proj(out.reshape(1, tokens, -1)), None


def attention_inputs(q, k, v, cos, sin, norms, pool_k, pool_v, slots) -> torch.Tensor:
    """`q` [T, heads, dim], `k`/`v` [T, kv heads, dim] (rows may be strided), `cos`/`sin` [T, dim],
    `norms` the (q, k) RMSNorm modules or Nones: k normed and rotated into `pool_k[slots]`, v into
    `pool_v[slots]`; returns q normed and rotated, [T, heads, dim]."""
    tokens, heads, dim = q.shape
    kv_heads = k.shape[1]
    q_norm, k_norm = norms
    query = torch.empty(tokens, heads, dim, dtype=q.dtype, device=q.device)
    if tokens == 0:
        return query
    for t in (q, k, v):
        assert t.stride(2) == 1 and t.stride(1) == dim, "heads of one token lie back to back"
    assert cos.stride(-1) == 1 and sin.stride(0) == cos.stride(0)
    q_weight = q_norm.weight if q_norm is not None else q  # never read without the norm
    k_weight = k_norm.weight if k_norm is not None else k
    _inputs_kernel[(tokens, heads + kv_heads)](
        q, k, v, q.stride(0), k.stride(0), v.stride(0), cos, sin, cos.stride(0),
        q_weight, k_weight, _eps(q_norm), _eps(k_norm), query, pool_k, pool_v, slots,
        HEADS=heads, KV_HEADS=kv_heads, HALF=dim // 2, Q_NORM=q_norm is not None, K_NORM=k_norm is not None,
        **LAUNCH,
    )  # fmt: skip
    return query


def self_check(device: torch.device, dtype: torch.dtype) -> str | None:
    """Run the kernel once on random heads against transformers' own RMSNorm and rotary; what went
    wrong, or None. A GPU it never ran on compiles it here, not inside a graph capture."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, apply_rotary_pos_emb

    gen = torch.Generator().manual_seed(0)
    tokens, heads, kv_heads, dim = 3, 4, 2, 64
    q, k, v = (torch.randn(tokens, h, dim, generator=gen).to(device, dtype) for h in (heads, kv_heads, kv_heads))
    angles = torch.rand(tokens, dim // 2, generator=gen).repeat(1, 2) * 6
    cos, sin = angles.cos().to(device, dtype), angles.sin().to(device, dtype)
    norms = tuple(Qwen3RMSNorm(dim, eps=1e-6).to(device, dtype) for _ in range(2))
    with torch.no_grad():
        for norm in norms:
            norm.weight.copy_(torch.rand(dim, generator=gen) + 0.5)
    pool_k, pool_v = (torch.zeros(tokens, kv_heads, dim, dtype=dtype, device=device) for _ in range(2))
    try:
        query = attention_inputs(q, k, v, cos, sin, norms, pool_k, pool_v, torch.arange(tokens, device=device))
    except Exception as exc:  # a Triton build that cannot compile it here
        return f"the kernel failed on {device}: {type(exc).__name__}: {exc}"
    with torch.no_grad():
        want_q, want_k = apply_rotary_pos_emb(
            norms[0](q).transpose(0, 1)[None], norms[1](k).transpose(0, 1)[None], cos[None], sin[None]
        )
    ulps = 2.0**-5 if dtype in (torch.bfloat16, torch.float16) else 1e-5  # relative: 4 of bf16's ulps
    for name, got, want in (
        ("q", query, want_q[0].transpose(0, 1)),
        ("k", pool_k, want_k[0].transpose(0, 1)),
        ("v", pool_v, v),
    ):
        error = (got.float() - want.float()).abs().max().item()
        if not error <= ulps * want.float().abs().max().item():
            return f"{name} differs from transformers' by {error:.3g} on {device} ({dtype})"
    return None


def _eps(norm) -> float:
    return float(getattr(norm, "variance_epsilon", 0.0)) if norm is not None else 0.0


if triton is not None:

    @triton.jit
    def _normed(x1, x2, w_ptr, eps, cols, HALF: tl.constexpr):
        """RMSNorm over the two halves of one head, as kv/norm_kernel.py: normalise in float32,
        round to the input's dtype, scale by the weight in float32, round once."""
        f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
        variance = (tl.sum(f1 * f1, 0) + tl.sum(f2 * f2, 0)) / (2 * HALF)
        scale = tl.rsqrt(variance + eps)
        n1, n2 = (f1 * scale).to(x1.dtype), (f2 * scale).to(x1.dtype)
        w1, w2 = tl.load(w_ptr + cols).to(tl.float32), tl.load(w_ptr + HALF + cols).to(tl.float32)
        return (w1 * n1.to(tl.float32)).to(x1.dtype), (w2 * n2.to(tl.float32)).to(x1.dtype)

    @triton.jit
    def _rotated(x1, x2, c1, c2, s1, s2):
        """`x * cos + rotate_half(x) * sin` rounded as torch rounds it in x's dtype: each product,
        then the sum (rotate_half(x) = [-x2, x1])."""
        f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
        a1, a2 = (f1 * c1.to(tl.float32)).to(x1.dtype), (f2 * c2.to(tl.float32)).to(x1.dtype)
        b1, b2 = (-f2 * s1.to(tl.float32)).to(x1.dtype), (f1 * s2.to(tl.float32)).to(x1.dtype)
        return (a1.to(tl.float32) + b1.to(tl.float32)).to(x1.dtype), (a2.to(tl.float32) + b2.to(tl.float32)).to(
            x1.dtype
        )

    @triton.jit
    def _inputs_kernel(
        q_ptr, k_ptr, v_ptr, q_stride, k_stride, v_stride, cos_ptr, sin_ptr, cs_stride,
        qw_ptr, kw_ptr, q_eps, k_eps, out_ptr, pool_k_ptr, pool_v_ptr, slots_ptr,
        HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HALF: tl.constexpr, Q_NORM: tl.constexpr, K_NORM: tl.constexpr,
    ):  # fmt: skip
        token = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        cols = tl.arange(0, HALF)
        c1, c2 = tl.load(cos_ptr + token * cs_stride + cols), tl.load(cos_ptr + token * cs_stride + HALF + cols)
        s1, s2 = tl.load(sin_ptr + token * cs_stride + cols), tl.load(sin_ptr + token * cs_stride + HALF + cols)
        if head < HEADS:
            source = q_ptr + token * q_stride + head * 2 * HALF
            x1, x2 = tl.load(source + cols), tl.load(source + HALF + cols)
            if Q_NORM:
                x1, x2 = _normed(x1, x2, qw_ptr, q_eps, cols, HALF)
            r1, r2 = _rotated(x1, x2, c1, c2, s1, s2)
            target = out_ptr + (token * HEADS + head) * 2 * HALF
            tl.store(target + cols, r1)
            tl.store(target + HALF + cols, r2)
        else:  # names of their own: Triton merges a name set in both branches, and their types differ
            kv = head - HEADS
            slot = tl.load(slots_ptr + token).to(tl.int64)
            k_source = k_ptr + token * k_stride + kv * 2 * HALF
            x1, x2 = tl.load(k_source + cols), tl.load(k_source + HALF + cols)
            if K_NORM:
                x1, x2 = _normed(x1, x2, kw_ptr, k_eps, cols, HALF)
            r1, r2 = _rotated(x1, x2, c1, c2, s1, s2)
            at = (slot * KV_HEADS + kv) * 2 * HALF
            tl.store(pool_k_ptr + at + cols, r1.to(pool_k_ptr.dtype.element_ty))
            tl.store(pool_k_ptr + at + HALF + cols, r2.to(pool_k_ptr.dtype.element_ty))
            v_source = v_ptr + token * v_stride + kv * 2 * HALF
            v1, v2 = tl.load(v_source + cols), tl.load(v_source + HALF + cols)
            tl.store(pool_v_ptr + at + cols, v1.to(pool_v_ptr.dtype.element_ty))
            tl.store(pool_v_ptr + at + HALF + cols, v2.to(pool_v_ptr.dtype.element_ty))
