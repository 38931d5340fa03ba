"""The attention layer's inputs in one kernel (engine/kv/qkv_kernel.py) against transformers' own
norms and rotary, and a whole model's paged steps with and without it.

Runs where Triton runs (tests/triton_here.py).
"""

from __future__ import annotations

import pytest
import torch
from triton_here import triton_device

DEVICE = triton_device()

from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: E402
from transformers.models.qwen3.modeling_qwen3 import (  # noqa: E402
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    apply_rotary_pos_emb,
)

from rollfleet.engine.kv.blocks import BlockPool  # noqa: E402
from rollfleet.engine.kv.fused_projections import fuse_projections, silu_mul  # noqa: E402
from rollfleet.engine.kv.norm_kernel import rms_norm  # noqa: E402
from rollfleet.engine.kv.paged import PagedModel  # noqa: E402
from rollfleet.engine.kv.qkv_kernel import FUSABLE, attention_inputs, fuse_attention_inputs  # noqa: E402
from rollfleet.tiny_models import tiny_config  # noqa: E402

# Triton's CPU interpreter truncates a cast to bfloat16 where a GPU rounds to nearest even (as torch):
# bit for bit on a GPU, within the truncation's ulps under the interpreter
INTERPRETED_BF16 = {"atol": 0.06, "rtol": 0.02} if DEVICE.type == "cpu" else {"atol": 0, "rtol": 0}


def _rotary(dim: int, positions: torch.Tensor, dtype: torch.dtype):
    config = tiny_config("qwen3", head_dim=dim)
    cos, sin = Qwen3RotaryEmbedding(config).to(DEVICE)(torch.zeros(1, dtype=dtype, device=DEVICE), positions[None])
    return cos, sin  # [1, T, dim] in dtype, as a decoder layer gets them


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("with_norms", [True, False])  # Qwen3's q/k norms; Llama's layers have none
def test_the_kernel_gives_transformers_norms_and_rotary_and_writes_the_slots(dtype, with_norms):
    torch.manual_seed(0)
    tokens, heads, kv_heads, dim, slots = 5, 4, 2, 16, 12
    fused = (torch.randn(tokens, (heads + 2 * kv_heads) * dim) * 2).to(DEVICE, dtype)  # one projection's rows
    q, k, v = fused.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=1)  # strided rows, as a fused qkv's
    q, k, v = (t.view(tokens, -1, dim) for t in (q, k, v))
    norms = (None, None)
    if with_norms:
        norms = tuple(Qwen3RMSNorm(dim, eps=1e-6).to(DEVICE, dtype) for _ in range(2))
        with torch.no_grad():
            for norm in norms:
                norm.weight.copy_(torch.randn(dim) * 0.5 + 1)
    positions = torch.tensor([0, 3, 7, 100, 511], device=DEVICE)
    cos, sin = _rotary(dim, positions, dtype)
    where = torch.tensor([3, 0, 11, 6, 7], device=DEVICE)
    pool_k = torch.full((slots, kv_heads, dim), 7.0, dtype=dtype, device=DEVICE)
    pool_v = pool_k.clone()
    query = attention_inputs(q, k, v, cos[0], sin[0], norms, pool_k, pool_v, where)

    def normed(x, norm):  # the fast path's norm (kv/norm_kernel.py), or transformers' module
        return x if norm is None else rms_norm(x, norm.weight, norm.variance_epsilon)

    want_q, want_k = apply_rotary_pos_emb(
        normed(q, norms[0]).transpose(0, 1)[None], normed(k, norms[1]).transpose(0, 1)[None], cos, sin
    )
    exact = INTERPRETED_BF16 if dtype == torch.bfloat16 else {"atol": 0, "rtol": 0}
    if with_norms:  # the norm sums a head's squares in two halves (one rounding more or less than the norm kernel)
        exact = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 1e-2}
    torch.testing.assert_close(query, want_q[0].transpose(0, 1), **exact)
    torch.testing.assert_close(pool_k[where], want_k[0].transpose(0, 1), **exact)
    assert torch.equal(pool_v[where], v)  # v as it came
    untouched = torch.ones(slots, dtype=torch.bool, device=DEVICE)
    untouched[where] = False
    assert (pool_k[untouched] == 7).all() and (pool_v[untouched] == 7).all()


def test_without_norms_the_rotary_is_transformers_bit_for_bit_on_a_gpu():
    torch.manual_seed(1)
    tokens, heads, kv_heads, dim = 9, 8, 2, 64
    q, k, v = (torch.randn(tokens, h, dim).to(DEVICE, torch.bfloat16) for h in (heads, kv_heads, kv_heads))
    cos, sin = _rotary(dim, torch.arange(100, 100 + tokens, device=DEVICE), torch.bfloat16)
    pool_k = torch.zeros(tokens, kv_heads, dim, dtype=torch.bfloat16, device=DEVICE)
    pool_v = torch.zeros_like(pool_k)
    query = attention_inputs(q, k, v, cos[0], sin[0], (None, None), pool_k, pool_v, torch.arange(tokens, device=DEVICE))
    want_q, want_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    torch.testing.assert_close(query, want_q[0].transpose(0, 1), **INTERPRETED_BF16)
    torch.testing.assert_close(pool_k, want_k[0].transpose(0, 1), **INTERPRETED_BF16)


def _llama_config():
    return LlamaConfig(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=False,
    )  # fmt: skip


@pytest.mark.parametrize(
    "config", [tiny_config("qwen3"), tiny_config("qwen3_moe"), _llama_config()], ids=lambda c: c.model_type
)
def test_a_models_paged_steps_keep_their_logits_with_the_fused_inputs(config):
    """Prefills (one and several rows, chunked) and decode steps of a tiny model on the paged pool:
    the same logits with fused projections and the fused forward as with transformers' forward and
    our attention function."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(DEVICE).eval()

    class _NoAdapter:
        def use(self, name):
            pass

    def run(fuse: bool) -> list[torch.Tensor]:
        paged = PagedModel(model, _NoAdapter(), None, tp_size=1, device=DEVICE, page_size=4, graphs=False, kernel=False)
        paged.allocate(num_pages=40, max_graph_batch=0)
        if fuse:  # as the engine's fast path: projections first (kv/paged.py fuse_fast_path), then the forward
            assert fuse_projections(model, FUSABLE)[0] == config.num_hidden_layers
            assert fuse_attention_inputs(model) == config.num_hidden_layers
        blocks = BlockPool(40, 4)
        a, b = blocks.allocate(4), blocks.allocate(4)
        steps = [
            ([(0, [5, 6, 7, 8, 9], a), (0, [11, 12], b)], [4, 6]),  # two prompts in one prefill
            ([(5, [21], a), (2, [22, 23, 24], b)], [0, 3]),  # a decode row beside a chunk
            ([(6, [31], a), (5, [32], b)], [0, 1]),  # a decode step
        ]
        return [paged.step(rows, logits_at=at) for rows, at in steps]

    want = run(fuse=False)
    got = run(fuse=True)
    for step, (g, w) in enumerate(zip(got, want)):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5, msg=f"step {step}")
    assert sum("forward" in vars(m) for m in model.modules() if type(m).__name__.endswith("Attention")) == len(
        model.model.layers
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_start_check_passes_here_and_catches_a_wrong_rotation(dtype, monkeypatch):
    """fuse_attention_inputs runs the kernel once before giving it to the layers: a kernel that does
    not give torch's figures on this device leaves transformers' forward in place."""
    from rollfleet.engine.kv import qkv_kernel

    assert qkv_kernel.self_check(DEVICE, dtype) is None
    monkeypatch.setattr(qkv_kernel, "attention_inputs", lambda q, k, v, *a: torch.zeros_like(q))
    assert "q differs" in qkv_kernel.self_check(DEVICE, dtype)
    model = AutoModelForCausalLM.from_config(tiny_config("qwen3")).to(DEVICE, dtype)
    assert qkv_kernel.fuse_attention_inputs(model) == 0
    assert not any("forward" in vars(m) for m in model.modules() if type(m).__name__ == "Qwen3Attention")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_mlps_silu_and_product_are_torchs(dtype):
    torch.manual_seed(2)
    gate_up = (torch.randn(3, 5, 2 * 1500) * 3).to(DEVICE, dtype)  # a width past one block, odd rows
    gate, up = gate_up.split(1500, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    # Triton's exp is not torch's: an ulp apart at times, on a GPU too
    tolerance = {"atol": 0.06, "rtol": 0.02} if dtype == torch.bfloat16 else {"atol": 1e-5, "rtol": 1e-5}
    torch.testing.assert_close(silu_mul(gate_up), want, **tolerance)
