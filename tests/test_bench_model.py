"""The benchmarks' model (rollfleet.bench.shapes): deep enough that an all-zero embedding row matters.
The copy task's prompt was the pad token under the bench's first word-level tokenizer (any prompt of
unknown words still is: they map to it); a zero row stays zero
through every layer and each RMSNorm's backward scales its gradient by 1/sqrt(eps), so a deep model's
first step went NaN on the GPU. The bench model draws that row like the others; transformers' zero
init is kept for the tiny test models (pad_row="zero"), and is what this test shows failing."""

from __future__ import annotations

import math

import pytest
import torch

from rollfleet.bench.shapes import TEST_VOCAB, qwen3_shape, write_model
from rollfleet.config import TrainConfig
from rollfleet.tiny_models import make_tiny_model, make_tokenizer
from rollfleet.train.fsdp import PolicyTrainer

HIDDEN, LAYERS = 256, 24


def first_step_grad_norm(path) -> float:
    generator = torch.Generator().manual_seed(0)
    batch = [
        {
            "prompt_ids": [0],  # the pad token: what an unknown word tokenizes to under the bench tokenizer
            "output_ids": torch.randint(3, TEST_VOCAB, (16,), generator=generator).tolist(),
            "logprobs": [-5.0] * 16,
            "advantage": (-1) ** i * 0.7,
        }
        for i in range(4)
    ]
    return PolicyTrainer(path, TrainConfig(lr=1e-6)).train_step(batch)["grad_norm"]


@pytest.mark.usefixtures("gloo_world_of_one")
def test_the_bench_model_trains_from_a_pad_token_prompt_where_a_zero_row_goes_nan(tmp_path):
    bench = write_model(tmp_path / "bench", HIDDEN, LAYERS, torch.float32, vocab=TEST_VOCAB)
    assert math.isfinite(first_step_grad_norm(bench))
    zero_row = make_tiny_model(tmp_path / "zero", tokenizer=make_tokenizer(), **qwen3_shape(HIDDEN, LAYERS))
    assert math.isnan(first_step_grad_norm(zero_row))  # what the bench model avoids
