"""The one-kernel RMSNorm (engine/kv/norm_kernel.py) against transformers' own module.

Runs where Triton runs (tests/triton_here.py).
"""

from __future__ import annotations

import pytest
import torch
from triton_here import triton_device

DEVICE = triton_device()

from transformers import AutoModelForCausalLM  # noqa: E402
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm  # noqa: E402

from rollfleet.engine.kv.norm_kernel import fusable, fuse_rms_norms, rms_norm  # noqa: E402
from rollfleet.tiny_models import tiny_config  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 64), (2, 5, 4, 16), (1, 1, 100)])  # a q-norm's per-head rows; odd widths
def test_the_kernel_gives_what_transformers_module_gives(dtype, shape):
    torch.manual_seed(0)
    norm = Qwen3RMSNorm(shape[-1], eps=1e-6).to(DEVICE, dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(shape[-1]) * 0.5 + 1)
    x = (torch.randn(shape) * 3).to(DEVICE, dtype)
    want = norm(x)
    got = rms_norm(x, norm.weight, norm.variance_epsilon)
    assert got.dtype == want.dtype and got.shape == want.shape
    tolerance = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 1e-2}
    torch.testing.assert_close(got, want, **tolerance)
    wide = (torch.randn(*shape[:-1], 2 * shape[-1]) * 3).to(DEVICE, dtype)
    for view in (wide[..., ::2], wide[..., : shape[-1]]):  # strided columns; rows further apart than a row
        torch.testing.assert_close(rms_norm(view, norm.weight, norm.variance_epsilon), norm(view), **tolerance)


def test_a_whole_model_keeps_its_logits_with_fused_norms():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("qwen3")).to(DEVICE).eval()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]], device=DEVICE)
    with torch.no_grad():
        want = model(ids).logits
        fused = fuse_rms_norms(model)
        got = model(ids).logits
    layers = model.config.num_hidden_layers
    assert fused == 4 * layers + 1  # input, post-attention, q and k norms a layer, and the final norm
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert not fusable(torch.nn.LayerNorm(8))  # other norms keep their own forward
