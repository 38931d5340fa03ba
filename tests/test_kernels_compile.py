"""Every Triton kernel of the engine compiles for the GPUs it runs on (sm_90: H100, H200; sm_80: A100)
in each dtype it is launched with, on a machine without a GPU: Triton's compiler runs on the CPU, down to PTX and
a cubin (the wheel brings its ptxas).

Triton's interpreter (tests/triton_here.py) runs a kernel as Python and takes code the compiler
refuses: the qkv kernel gave a name a pointer in one branch of an `if` and an integer in the other,
passed every interpreter test, and failed to compile on the H200 (2026-12-05), so the engines ran
without it. The compiles run in a process of their own, where TRITON_INTERPRET is unset (the kernel
modules decide at import whether they are interpreted). Skips without Triton (CPU CI).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

# found, not imported: this process's Triton may be the interpreter's (tests/triton_here.py), set at import
if importlib.util.find_spec("triton") is None:
    pytest.skip("Triton is not installed (torch's CPU wheel has none)", allow_module_level=True)

# (case, module, kernel, {argument: Triton type}, {constexpr: value}); arguments not named are "i64"
BF16 = "*bf16"
CASES = [
    *(
        (
            f"qkv-{dtype[1:]}-norms-{norms}",
            "rollfleet.engine.kv.qkv_kernel",
            "_inputs_kernel",
            {
                **dict.fromkeys(["q_ptr", "k_ptr", "v_ptr", "cos_ptr", "sin_ptr", "qw_ptr", "kw_ptr"], dtype),
                **dict.fromkeys(["out_ptr", "pool_k_ptr", "pool_v_ptr"], dtype),
                "slots_ptr": "*i64",
                **dict.fromkeys(["q_eps", "k_eps"], "fp32"),
            },
            {"HEADS": 16, "KV_HEADS": 8, "HALF": 64, "Q_NORM": norms, "K_NORM": norms},
        )
        for dtype in (BF16, "*fp32")
        for norms in (True, False)
    ),
    *(
        (
            f"decode-split-{dtype[1:]}-prefix-{prefix}",
            "rollfleet.engine.kv.decode_kernel",
            "_split_kernel",
            {
                **dict.fromkeys(["q_ptr", "k_ptr", "v_ptr"], dtype),
                **dict.fromkeys(["table_ptr", "lens_ptr", "skip_ptr"], "*i64"),
                **dict.fromkeys(["part_ptr", "lse_ptr"], "*fp32"),
                "scale": "fp32",
            },
            {"GROUP": 2, "GROUP_PAD": 16, "DIM": 128, "DIM_PAD": 128, "PAGE": 16, "BLOCK": 32, "PRECISION": precision}
            | {"HAS_PREFIX": prefix},
        )
        for dtype, precision in ((BF16, "tf32"), ("*fp32", "ieee"))
        for prefix in (False, True)
    ),
    *(
        (
            f"decode-prefix-{dtype[1:]}",
            "rollfleet.engine.kv.decode_kernel",
            "_prefix_kernel",
            {
                **dict.fromkeys(["q_ptr", "k_ptr", "v_ptr"], dtype),
                **dict.fromkeys(["table_ptr", "prefix_ptr"], "*i64"),
                **dict.fromkeys(["part_ptr", "lse_ptr"], "*fp32"),
                "scale": "fp32",
            },
            {"MEMBERS": 16, "QUERIES": 64, "GROUP": 4, "GROUP_PAD": 16, "DIM": 128, "DIM_PAD": 128, "PAGE": 16}
            | {"BLOCK": 32, "PRECISION": precision},
        )
        for dtype, precision in ((BF16, "tf32"), ("*fp32", "ieee"))
    ),
    (
        "decode-merge-bf16",
        "rollfleet.engine.kv.decode_kernel",
        "_merge_kernel",
        {"part_ptr": "*fp32", "lse_ptr": "*fp32", "out_ptr": BF16},
        {"SPLITS_PAD": 8, "DIM_PAD": 128},
    ),
    *(
        (
            f"rmsnorm-{dtype[1:]}",
            "rollfleet.engine.kv.norm_kernel",
            "_norm_kernel",
            {"x_ptr": dtype, "w_ptr": dtype, "out_ptr": dtype, "eps": "fp32"},
            {"BLOCK": 2048},
        )
        for dtype in (BF16, "*fp32")
    ),
    (
        "silu-mul-bf16",
        "rollfleet.engine.kv.fused_projections",
        "_silu_mul_kernel",
        {"x_ptr": BF16, "out_ptr": BF16},
        {"BLOCK": 1024},
    ),
    *(
        (
            f"sample-{dtype[1:]}-seeded-{seeded}",
            "rollfleet.engine.sequences.sample_kernel",
            "_sample_kernel",
            {
                "logits_ptr": dtype,
                "inv_temp_ptr": "*fp32",
                "greedy_ptr": "*i1",
                "seed": "i32",
                **dict.fromkeys(["keys_ptr", "tokens_ptr"], "*i64"),
                "logprobs_ptr": "*fp32",
            },
            {"VOCAB": 151_936, "SEEDED": seeded, "TINY": 1.1754943508222875e-38, "LOWEST": -3.4e38, "BLOCK": 2048},
        )
        for dtype in (BF16, "*fp32")
        for seeded in (True, False)
    ),
]

COMPILE = """
import importlib, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

results = {}
for case, module, name, types, constants in json.loads(sys.stdin.read()):
    kernel = getattr(importlib.import_module(module), name)
    signature = {arg: "constexpr" if arg in constants else types.get(arg, "i64") for arg in kernel.arg_names}
    constexprs = {(kernel.arg_names.index(arg),): value for arg, value in constants.items()}
    options = getattr(importlib.import_module(module), "LAUNCH", {})  # what the module launches it with
    for arch in (90, 80):
        try:
            source = ASTSource(kernel, signature, constexprs)
            compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
            ptx = compiled.asm["ptx"]
            results[f"{case} sm_{arch}"] = {"cubin": bool(compiled.asm.get("cubin")), "fma": "fma." in ptx}
        except Exception as exc:
            results[f"{case} sm_{arch}"] = {"error": f"{type(exc).__name__}: {exc}"}
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def compiled() -> dict[str, dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", COMPILE], input=json.dumps(CASES), capture_output=True, text=True, env=env, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("arch", [90, 80])
@pytest.mark.parametrize("case", [case[0] for case in CASES])
def test_the_kernel_compiles(compiled, case, arch):
    assert compiled[f"{case} sm_{arch}"].get("cubin"), compiled[f"{case} sm_{arch}"]


@pytest.mark.parametrize("case", [f"{case[0]} sm_90" for case in CASES if case[0].startswith("qkv-")])
def test_the_rotary_rounds_each_product_as_torch_does(compiled, case):
    """No fused multiply-add in the qkv kernel: torch rounds `x * cos` and `rotate_half(x) * sin`
    before their sum; an FMA rounds once (on an H100, 1 of 6 values 1 ulp from transformers').
    sm_90 only: sm_80 has no bf16 mul or add, and its PTX writes each as an exact fma with -0 or 1."""
    assert compiled[case].get("fma") is False, compiled[case]
