"""Tiny models and tokenizers made in code, for tests, the CPU demo and benchmarks (no hub access).

`make_tiny_model(directory, kind)` writes a complete HF model directory: config, random weights
from a fixed seed, a byte-level BPE tokenizer trained in milliseconds, and a generation config.
`make_word_tokenizer(vocab_size)` builds a word-level tokenizer of exactly that many entries (a real
model's vocabulary size, e.g. 151,936) without training, for benchmarks that need a real-sized vocabulary.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, GenerationConfig, PreTrainedTokenizerFast, Qwen3Config, Qwen3MoeConfig

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# ChatML, as Qwen's chat models write it: `<|im_start|>role\ncontent<|im_end|>\n` per message
CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "what is 12 plus 7? the answer is 19.",
    "reinforcement learning with verifiable rewards trains a policy from samples",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20",
    "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ .,;:!?+-*/=()",
] * 20


def make_tokenizer(vocab_size: int = 320) -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(CORPUS, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<|endoftext|>", pad_token="<|endoftext|>", bos_token=None
    )


# The synthetic copy task's pieces ("copy:381=" -> copy, :, 3, 8, 1, =), first after the special tokens,
# so that a benchmark model with a real vocabulary can learn the task (a prompt of unknown words cannot)
COPY_TASK_PIECES = ["\u2581copy", ":", "="] + [str(digit) for digit in range(10)]


def make_word_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A word-level tokenizer of exactly `vocab_size` entries: the tiny tokenizer's special tokens first
    (ids 0-2, so eos = pad = 0 as in `tiny_config`), then the copy task's pieces (COPY_TASK_PIECES: its
    prompts are known tokens, and digits decode without spaces between them, as its reward reads
    them), then the words `w16`, `w17`, ... up to `vocab_size - 1` (word `wN` is token N; an unknown
    piece maps to eos). Spaces are kept as SentencePiece keeps them (a word's leading U+2581), so
    words decode with spaces between them. Built from a dict, no training: well under a second for 151,936."""
    first_word = len(SPECIAL_TOKENS) + len(COPY_TASK_PIECES)
    if vocab_size <= first_word:
        raise ValueError(f"vocab_size={vocab_size}: must exceed the {first_word} special tokens and copy-task pieces")
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + COPY_TASK_PIECES)}
    vocab.update((f"\u2581w{i}", i) for i in range(first_word, vocab_size))
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token=SPECIAL_TOKENS[0]))
    space = {"replacement": "\u2581", "prepend_scheme": "always", "split": False}
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [  # a word (with its space), one digit, or one other character
            pre_tokenizers.Metaspace(**space),
            pre_tokenizers.Split(Regex(r"\u2581?[A-Za-z]\w*|\d|[^\w\u2581]"), behavior="isolated"),
        ]
    )
    tokenizer.decoder = decoders.Metaspace(**space)
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<|endoftext|>", pad_token="<|endoftext|>", bos_token=None
    )


def tiny_config(kind: str = "qwen3", vocab_size: int = 320, **overrides):
    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        eos_token_id=0,
        pad_token_id=0,
        bos_token_id=None,
    )
    if kind == "qwen3":
        return Qwen3Config(**{**common, "intermediate_size": 128, **overrides})
    if kind == "qwen3_moe":
        return Qwen3MoeConfig(
            **{
                **common,
                "intermediate_size": 128,
                "moe_intermediate_size": 32,
                "num_experts": 4,
                "num_experts_per_tok": 2,
                **overrides,
            }
        )
    raise ValueError(f"kind={kind!r}: use 'qwen3' or 'qwen3_moe'")


def make_tiny_model(
    directory: str | Path,
    kind: str = "qwen3",
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    tokenizer: PreTrainedTokenizerFast | None = None,
    chat_template: str | None = None,
    pad_row: str = "zero",
    **overrides,
) -> Path:
    """Write a tiny HF model directory (weights in `dtype`) and return its path; the vocabulary is the
    tokenizer's (default: the tiny BPE tokenizer, 320 entries); `chat_template` (e.g. CHATML_TEMPLATE)
    is saved with the tokenizer. `pad_row`: "zero" keeps transformers' init of the pad token's
    embedding (all zeros); "random" draws it like every other row, as in a trained checkpoint (see
    rollfleet.bench.shapes: a zero row is a deep model's NaN)."""
    directory = Path(directory)
    tokenizer = tokenizer or make_tokenizer()
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    torch.manual_seed(seed)
    config = tiny_config(kind, vocab_size=len(tokenizer), **overrides)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if pad_row == "random" and config.pad_token_id is not None:
        with torch.no_grad():
            model.get_input_embeddings().weight[config.pad_token_id].normal_(0.0, config.initializer_range)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id).save_pretrained(
        directory
    )
    return directory
