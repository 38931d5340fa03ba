"""Logprobs as SGLang returns them in `meta_info`: of the prompt's tokens (`logprob_start_len >= 0`),
the top-k at each position (`top_logprobs_num`) and of chosen token ids (`token_ids_logprob`).

Input logprobs are `log_softmax` of the raw logits; output ones are taken by the sampler
(sampling.py) as SGLang 0.5.23 takes them: `log_softmax(logits / temperature)` (raw for a greedy
row), before top-k / top-p / min-p. Both are computed on the model's device; only the values asked
for cross to the host. SGLang's layout, kept here because its clients index into it:
- `input_token_logprobs` holds one `[logprob, token_id, text]` per prompt token from
  `logprob_start_len` on; the first entry's logprob is None (SGLang prepends None and drops the
  last position, whose logits predict the first output token), whatever the start.
- `input_top_logprobs` / `input_token_ids_logprobs`: one row per such token, the first None;
  a row is a list of `[logprob, token_id, text]`.
- `output_*` likewise, one entry or row per output token (no None).
`text` is the token's own decoded text with `return_text_in_logprobs`, else None.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import repeat
from typing import Any

import torch

Row = list[tuple[float, int]]


@dataclass(frozen=True)
class LogprobAsk:
    """What one request asked for, beyond the output tokens' own logprobs."""

    start: int = -1  # logprob_start_len: -1 = no input logprobs
    top_n: int = 0
    token_ids: tuple[int, ...] | None = None
    with_text: bool = False
    values_only: bool = False  # return_logprob_values (rollfleet.wire.protocol): output logprobs as one list

    @property
    def wants_input(self) -> bool:
        return self.start >= 0


@dataclass
class LogprobRecord:
    """The logprobs of one sample, filled as it runs (input ones at prefill, output ones per token)."""

    input_values: list[float | None] = field(default_factory=list)
    input_ids: list[int] = field(default_factory=list)
    input_top: list[Row | None] = field(default_factory=list)
    input_chosen: list[Row | None] = field(default_factory=list)
    output_top: list[Row] = field(default_factory=list)
    output_chosen: list[Row] = field(default_factory=list)

    def fork(self) -> LogprobRecord:
        """The record of another sample of the same prompt (kv/steps.py `_fork`): the input lists
        shared (`fill_input` replaces them whole, nothing changes one in place), the output ones its
        own (each token appends to them). copy.deepcopy took 9-37 us a sample: 4-17 ms of a 64 x 8
        wave's prefill step on a 2-core CPU."""
        top, chosen = list(self.output_top), list(self.output_chosen)
        return LogprobRecord(self.input_values, self.input_ids, self.input_top, self.input_chosen, top, chosen)


def input_positions(prompt_len: int, ask: LogprobAsk) -> int:
    """How many prompt positions' logits (from `ask.start` up to the second-to-last token) the
    input logprobs need; 0 when none are asked for or the start is the prompt's end."""
    if not ask.wants_input:
        return 0
    return max(prompt_len - 1 - ask.start, 0)


def fill_input(record: LogprobRecord, logprobs: torch.Tensor, prompt: list[int], ask: LogprobAsk) -> int:
    """`logprobs[i]` is log_softmax at prompt position `ask.start + i` (it predicts token start+i+1),
    on the model's device; only the asked values cross to the host. Returns the bytes that crossed."""
    if not ask.wants_input or ask.start >= len(prompt):
        return 0
    following = torch.tensor(prompt[ask.start + 1 :], dtype=torch.long).to(logprobs.device)
    moved = [logprobs.gather(1, following[:, None])[:, 0]]
    record.input_values = [None, *moved[-1].tolist()]
    record.input_ids = list(prompt[ask.start :])
    if ask.top_n > 0:
        values, ids = torch.topk(logprobs, min(ask.top_n, logprobs.shape[1]), dim=-1)
        moved += [values, ids]
        record.input_top = [None, *(list(zip(v, i)) for v, i in zip(values.tolist(), ids.tolist()))]
    if ask.token_ids is not None:
        chosen = torch.tensor(ask.token_ids, dtype=torch.long).to(logprobs.device)
        moved.append(logprobs[:, chosen])
        record.input_chosen = [None, *(list(zip(row, ask.token_ids)) for row in moved[-1].tolist())]
    return sum(t.nbytes for t in moved)


def meta_fields(
    record: LogprobRecord,
    ask: LogprobAsk,
    values: list[float],
    tokens: list[int],
    tokenizer,
    upto: int | None = None,
) -> dict[str, Any]:
    """The logprob fields of `meta_info`; `values` and `tokens` are the output tokens' logprobs and
    ids so far (cut at `upto` already), `upto` cuts the output rows there too (a stream chunk).
    Entries are tuples (JSON arrays as the answer is written): a finished answer holds one per
    token, and 512 answers of 256 built as lists took 30 ms of the engine thread, as zipped tuples 12."""
    text_of = _texts(tokenizer) if ask.with_text else None

    def triples(values_, tokens_):
        return list(zip(values_, tokens_, repeat(None) if text_of is None else map(text_of, tokens_)))

    def rows(rows_):
        return [None if row is None else triples(*_columns(row)) for row in rows_]

    meta: dict[str, Any] = {"input_token_logprobs": triples(record.input_values, record.input_ids)}
    if ask.values_only:  # the values alone, one list (the ids are the answer's output_ids)
        meta["output_token_logprob_values"] = values
    else:
        meta["output_token_logprobs"] = triples(values, tokens)
    meta["output_token_logprobs_length"] = len(values)
    if ask.top_n > 0:
        meta["input_top_logprobs"] = rows(record.input_top)
        meta["output_top_logprobs"] = rows(record.output_top[:upto])
    if ask.token_ids is not None:
        meta["input_token_ids_logprobs"] = rows(record.input_chosen)
        meta["output_token_ids_logprobs"] = rows(record.output_chosen[:upto])
    return meta


def _columns(row: Row) -> tuple[list[float], list[int]]:
    """A row of (logprob, token) pairs as its two columns."""
    return [value for value, _ in row], [token for _, token in row]


def _texts(tokenizer):
    cache: dict[int, str] = {}

    def text_of(token: int) -> str:
        if token not in cache:
            cache[token] = tokenizer.decode([token])
        return cache[token]

    return text_of


def _input_positions_now(seq) -> int:
    """Input positions a prefill of `seq` fills: none for a sequence that has output (its prefix is
    recomputed after a retract or a weight update; its input logprobs were taken the first time)."""
    return 0 if seq.output_ids else input_positions(len(seq.prompt_ids), seq.ask)


def prefill_keep(seqs) -> int:
    """How many last positions' logits a prefill of `seqs` (left-padded) must return: 1 for the next
    token, plus the most input positions any of them asked for."""
    return 1 + max((_input_positions_now(s) for s in seqs), default=0)


def take_input_logprobs(seqs, logits: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Fill each sequence's input logprobs from a prefill's `[batch, keep, vocab]` logits (on the
    device) and return the last position's `[batch, vocab]` (the next token's) and the bytes that
    crossed to the host."""
    keep, moved = logits.shape[1], 0
    for row, seq in enumerate(seqs):
        count = _input_positions_now(seq)
        if seq.ask.wants_input and not seq.output_ids:
            positions = logits[row, keep - 1 - count : keep - 1].float()
            moved += fill_input(seq.record, torch.log_softmax(positions, dim=-1), seq.prompt_ids, seq.ask)
    return logits[:, -1, :], moved
