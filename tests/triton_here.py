"""Where the Triton kernels' tests run: a CUDA device, or the CPU under Triton's interpreter
(TRITON_INTERPRET=1, set before Triton is first imported) when the triton package is installed.
CPU CI has none (torch's CPU wheel does not bring it): those test modules skip, saying so, and
scripts/gpu_round_generate.sh runs them on the GPU. Triton 3.5's interpreter needs numpy < 2.4 for
the kernels whose loops run to a loaded bound (decode_kernel.py): it takes such a bound as
`int(array of one element)`, an error since numpy 2.4 (requirements.txt pins 2.4.6), e.g.
`pip install --target DIR "numpy==2.3.*"` and DIR first on PYTHONPATH."""

from __future__ import annotations

import os

import pytest
import torch


def triton_device() -> torch.device:
    """The device the calling test module runs its kernels on; skips the module without Triton.
    Call it before importing a kernel module (they import Triton)."""
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    pytest.importorskip("triton", reason="Triton is not installed (torch's CPU wheel has none): the GPU runs this")
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
