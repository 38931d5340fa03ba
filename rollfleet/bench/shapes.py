"""The one model shape every GPU benchmark uses: Qwen3-shaped, with a real model's vocabulary.

    write_model(directory, hidden=2048, layers=24, dtype=torch.bfloat16)   # 2.08B parameters, 4.2 GB

From hidden 1024 up: head_dim 128, hidden / 128 query heads, hidden / 512 KV heads, intermediate
4 x hidden (hidden 2048, 24 layers: 1.46B parameters without the embeddings, the step-time issue's
shape; 2.08B with the untied embedding and lm_head of 151,936 entries). Smaller hiddens (CPU
checks) keep 4 query heads over 2 KV heads. The vocabulary defaults to Qwen3's 151,936 with a
word-level tokenizer of that size (rollfleet.tiny_models.make_word_tokenizer): with the 320-token
test tokenizer the lm_head and the logits are 475 times smaller than any real model's, and every
figure measured with it flatters generation.
"""

from __future__ import annotations

from pathlib import Path

import torch

from rollfleet.tiny_models import make_tiny_model, make_tokenizer, make_word_tokenizer

REAL_VOCAB = 151_936  # Qwen2.5 / Qwen3
TEST_VOCAB = 320  # the tiny BPE tokenizer's (rollfleet.tiny_models.make_tokenizer)


def qwen3_shape(hidden: int, layers: int) -> dict[str, int]:
    """The config fields of the benchmark shape for `hidden` and `layers` (the vocabulary apart)."""
    big = hidden >= 1024
    return {
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": 4 * hidden,
        "num_attention_heads": hidden // 128 if big else 4,
        "num_key_value_heads": max(2, hidden // 512),
        "head_dim": 128 if big else hidden // 4,
        # Qwen3's own context: RL's long outputs (the generate bench's 16 x 8 x 8192, a GRPO step's 512
        # new tokens after its prompt) fit; the tiny test models' 512 would end them early
        "max_position_embeddings": 40960,
    }


def bench_tokenizer(vocab: int):
    """The tiny BPE tokenizer at its own size (what the tests use), else a word-level one of `vocab`."""
    return make_tokenizer() if vocab == TEST_VOCAB else make_word_tokenizer(vocab)


def write_model(
    directory: Path, hidden: int, layers: int, dtype: torch.dtype, vocab: int = REAL_VOCAB, seed: int = 0
) -> Path:
    """The benchmark model in `dtype` with random weights from `seed`, written once (kept if there).

    The pad token's embedding is drawn like every other row (`pad_row="random"`), not left at
    transformers' zeros: the copy task's prompts are that token here (eos = pad = unknown word), and a
    position whose embedding is exactly zero stays zero through every layer, where each RMSNorm's
    backward scales its gradient by 1/sqrt(eps): at 24 layers the first step's gradient is NaN (seen on
    1 x H200, reproduced on the CPU). A trained checkpoint has no zero row."""
    if (directory / "config.json").exists():
        return directory
    return make_tiny_model(
        directory,
        dtype=dtype,
        seed=seed,
        tokenizer=bench_tokenizer(vocab),
        pad_row="random",
        **qwen3_shape(hidden, layers),
    )


def add_vocab_flag(parser, default: int = REAL_VOCAB) -> None:
    parser.add_argument(
        "--vocab",
        type=int,
        default=default,
        help=f"vocabulary size (default {default:,}; {TEST_VOCAB}: the tiny test tokenizer, for quick CPU checks)",
    )
