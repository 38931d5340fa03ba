"""The scheduler's units of work: one sample being generated (a Sequence) and one control action,
and a finished sequence's answer in SGLang's /generate shape."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from rollfleet.engine.sequences.logprobs import LogprobAsk, LogprobRecord, meta_fields
from rollfleet.engine.sequences.sampling import SampleRow, seed_key
from rollfleet.engine.sequences.texts_ahead import backend_decodes_alone, piece_texts, rows_from
from rollfleet.wire.protocol import FinishReason, SamplingParams
from rollfleet.wire.routed_experts import encode_routed_experts

NOTHING_BANNED: frozenset[int] = frozenset()


@dataclass(eq=False)
class Sequence:
    """One sample being generated: a prompt, its sampling state and its output so far."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    key: int | None  # the seeded noise key (sampling.seed_key); None: unseeded
    return_logprob: bool
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: str = ""
    finish: FinishReason | None = None
    abort_message: str | None = None
    lora_name: str | None = None
    future: Future = field(default_factory=Future)
    ask: LogprobAsk = field(default_factory=LogprobAsk)  # input / top / chosen-id logprobs asked for
    record: LogprobRecord = field(default_factory=LogprobRecord)
    on_token: Callable[[Sequence], None] | None = None  # a stream's listener, called on the engine thread
    routes_start: int | None = None  # routed_experts_start_len when return_routed_experts was asked
    routes: list[torch.Tensor] = field(default_factory=list)  # [positions, layers, top_k] per forward
    # (old version, output tokens made with it) at each weight-version change while unfinished
    version_events: list[tuple[str, int]] = field(default_factory=list)
    # the paged KV pool's view (kv/steps.py): pages holding the KV of the first kv_len tokens of
    # prompt + output, what made that KV (the weights and adapter, as the prefix cache keys it), how
    # many of them came from the prefix cache or a sibling, the sample whose prefill this one waits for
    pages: list[int] = field(default_factory=list)
    kv_len: int = 0
    kv_root: str | None = None
    cached_tokens: int = 0
    fork_of: Sequence | None = None
    stop_ids: frozenset[int] | None = None  # the token ids that end it (next_token.StopRules.stop_ids)
    ahead_upto: int = 0  # output tokens whose text is decoded ahead (texts_ahead.py): `ahead_text`
    ahead_text: str = ""
    out_limit: int | None = None  # the output tokens at which it ends by length (StopRules.out_limit)

    @property
    def prefill_ids(self) -> list[int]:
        """What a prefill of this sequence reads: its prompt and the output made so far (a sequence
        whose KV cache was dropped, retracted or stale after a weight update, recomputes it)."""
        return self.prompt_ids + self.output_ids

    def sampling_row(self, stop_ids: Callable[[Sequence], set[int]], ahead: int = 0) -> SampleRow:
        """What the sampler needs of this sample for its next token (`ahead`: tokens drawn but not yet
        recorded, kv/overlap.py); its `stop_ids(self)` are banned while fewer than `min_new_tokens`
        tokens are out (asked for only then)."""
        position = len(self.output_ids) + ahead
        return SampleRow(
            self.params,
            self.key,
            position,
            frozenset(stop_ids(self)) if position < self.params.min_new_tokens else NOTHING_BANNED,
            self.ask.top_n,
            self.ask.token_ids,
            self.return_logprob,
        )

    def finished_text(self, tokenizer) -> str:
        """The text of the output ids, as SGLang's detokenizer trims it: without a matched stop
        token's own text unless `no_stop_trim` (a matched stop string is cut when it is found)."""
        return decode_ids(tokenizer, self.text_ids(), self.params.skip_special_tokens)

    def text_ids(self) -> list[int]:
        """The output ids `finished_text` decodes."""
        ids = self.output_ids
        if self.finish.type == "stop" and isinstance(self.finish.matched, int) and not self.params.no_stop_trim:
            ids = ids[:-1]
        return ids


def decode_ids(tokenizer, ids: list[int], skip_special_tokens: bool) -> str:
    """`tokenizer.decode(ids, skip_special_tokens=...)` of a list of ints, without transformers'
    `to_py_obj` walk over every id (checking each for a tensor or an array): two fifths of the time
    of 512 answers of 256 tokens (43 ms, 27 without). Its `_decode` is what `decode` then calls for
    one sequence (transformers 5); a tokenizer without one decodes the public way."""
    fast = getattr(tokenizer, "_decode", None)
    if fast is None:
        return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    return fast(ids, skip_special_tokens=skip_special_tokens)


def finished_texts(seqs: list[Sequence], tokenizer) -> list[str]:
    """`finished_text` of each of `seqs`, those that skip special tokens and those that keep them each
    in ONE call of the tokenizer's Rust backend where that is all its `_decode` does (a transformers
    fast tokenizer without the clean-up pass, e.g. Qwen's): the backend decodes them on its threads.
    Else one by one."""
    texts: list[str] = [""] * len(seqs)
    batched = backend_decodes_alone(tokenizer) and len(seqs) > 1
    for skip in (False, True):
        rows = [row for row, seq in enumerate(seqs) if bool(seq.params.skip_special_tokens) == skip]
        if not rows:
            continue
        ids = [seqs[row].text_ids() for row in rows]
        if batched:
            decoded = _joined_texts(tokenizer, [seqs[row] for row in rows], ids, skip)
        else:
            decoded = [decode_ids(tokenizer, one, skip) for one in ids]
        for row, text in zip(rows, decoded):
            texts[row] = text
    return texts


def _joined_texts(tokenizer, seqs: list[Sequence], ids: list[list[int]], skip: bool) -> list[str]:
    """Each text: its part decoded ahead (texts_ahead.py) and the rest, in one call of the Rust backend;
    a text whose rest cannot join its part (or whose part reaches past `ids`) is decoded whole."""
    rows = [
        rows_from(seq.ahead_upto if seq.ahead_upto <= len(one) else 0, one, len(one)) for seq, one in zip(seqs, ids)
    ]
    rests = piece_texts(tokenizer._tokenizer, rows, skip, at_end=True)
    texts = []
    for seq, one, (_, ahead), rest in zip(seqs, ids, rows, rests):
        if rest is None:  # the rest's context failed its check (a row without context never does at the end)
            texts.append(decode_ids(tokenizer, one, skip))
        else:
            texts.append(seq.ahead_text + rest if ahead else rest)
    return texts


def sample_group(
    prompt_ids: list[int],
    params: SamplingParams,
    rid: str,
    return_logprob: bool,
    lora_name: str | None,
    ask: LogprobAsk,
    routes_start: int | None = None,
) -> list[Sequence]:
    """The `params.n` samples of one prompt; SGLang's rids: `rid`, or `rid-i` for sample i when n > 1."""
    return [
        Sequence(
            rid if params.n == 1 else f"{rid}-{i}",
            prompt_ids,
            params,
            seed_key(params, i),
            return_logprob,
            lora_name=lora_name,
            ask=ask,
            routes_start=routes_start,
        )
        for i in range(params.n)
    ]


@dataclass
class ControlAction:
    fn: Callable[[], Any]
    needs_idle: bool
    waits_for: Callable[[Sequence], bool] | None = None  # runs only when no unfinished request matches
    future: Future = field(default_factory=Future)


def mark_version_change(seqs: Iterable[Sequence], old_version: str) -> None:
    """Where `old_version`'s tokens end in every unfinished sequence that has output."""
    for seq in seqs:
        if seq.output_ids:
            seq.version_events.append((old_version, len(seq.output_ids)))


def weight_version_spans(events: list[tuple[str, int]], current: str, num_tokens: int) -> list[dict[str, Any]]:
    """SGLang's `meta_info.weight_versions`: which weight version made which output tokens, as spans
    `{version, start, end}` over output token positions, `end` exclusive, in order, covering
    [0, num_tokens). `events` are (old version, tokens made so far) at each version change; a change
    with no token made since the last one adds no span, and equal neighbours merge. A request that
    made no token has one empty span of the current version."""
    spans: list[dict[str, Any]] = []
    for version, end in [*events, (current, num_tokens)]:
        end = min(end, num_tokens)
        if spans and end <= spans[-1]["end"]:
            continue
        if spans and spans[-1]["version"] == version:
            spans[-1]["end"] = end
            continue
        spans.append({"version": version, "start": spans[-1]["end"] if spans else 0, "end": end})
    return spans


def wire_result(
    seq: Sequence, weight_version: str, tokenizer=None, upto: int | None = None, text: str | None = None
) -> dict[str, Any]:
    """A finished sequence as one /generate answer (text, output_ids, meta_info); with `upto`, the
    sequence's first `upto` output tokens, unfinished (a stream chunk, cumulative as SGLang's), whose
    `text` the stream decoded (stream_text.py: decoding the whole output per chunk is quadratic).
    As SGLang, only a finished answer carries `weight_versions`; its `weight_version` is the last span's."""
    output_ids = seq.output_ids[:upto]
    meta = {
        "id": seq.rid,
        "prompt_tokens": len(seq.prompt_ids),
        "completion_tokens": len(output_ids),
        "cached_tokens": seq.cached_tokens,
        "weight_version": weight_version,
        "finish_reason": None if upto is not None else seq.finish.to_wire(),
    }
    if upto is None:
        meta["weight_versions"] = weight_version_spans(seq.version_events, weight_version, len(output_ids))
        meta["weight_version"] = meta["weight_versions"][-1]["version"]
    if seq.return_logprob:
        meta.update(meta_fields(seq.record, seq.ask, seq.logprobs[:upto], output_ids, tokenizer, upto))
    if seq.routes_start is not None and upto is None:  # SGLang collects them once the request finished
        meta["routed_experts"] = encode_routed_experts(routed_rows(seq)[seq.routes_start :])
    if upto is not None:
        assert text is not None, "a stream chunk's text comes from its StreamText"
        return {"text": text, "output_ids": output_ids, "meta_info": meta}
    return {"text": seq.text, "output_ids": output_ids, "meta_info": meta}


def record_routes(running: list[Sequence], routes: torch.Tensor) -> None:
    """Append the routes of one forward ([batch, positions, layers, top_k], left-padded at prefill) to the
    sequences that asked: a prefill's last len(prompt + output so far) positions (a recompute after a
    weight update reads the output again), a decode step's one position."""
    for row, seq in enumerate(running):
        if seq.routes_start is not None:
            seq.routes.append(routes[row, -(1 if seq.routes else len(seq.prefill_ids)) :])


def routed_rows(seq: Sequence) -> torch.Tensor:
    """Every position fed through the model so far, [prompt + output - 1, layers, top_k] once finished
    (the last output token is never fed back), as SGLang's `[0, seqlen - 1)`."""
    return torch.cat(seq.routes) if seq.routes else torch.zeros(0, dtype=torch.int32)
