"""How a sample records its next token, and when it stops, as SGLang decides it: a stop token (EOS
unless `ignore_eos`, and `stop_token_ids`; none before `min_new_tokens`), a stop string,
`max_new_tokens`, or the model's context length."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

from rollfleet.engine.sequences.logprobs import Row
from rollfleet.engine.sequences.sequence import Sequence, decode_ids
from rollfleet.wire.protocol import FinishReason


@dataclass(frozen=True)
class StopRules:
    eos_token_ids: frozenset[int]
    context_length: int
    tokenizer: object

    def stop_ids(self, seq: Sequence) -> frozenset[int]:
        """The token ids that end `seq` (its params never change: made once, kept on it)."""
        if seq.stop_ids is None:
            ids = frozenset(seq.params.stop_token_ids or [])
            seq.stop_ids = ids if seq.params.ignore_eos else ids | self.eos_token_ids
        return seq.stop_ids

    def finish_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        """Why `seq` finishes with `token`, its newest output token (None: it goes on). A matched stop
        string also sets the sample's text."""
        if token in self.stop_ids(seq):
            return FinishReason(type="stop", matched=token)
        if seq.params.stop is not None and seq.params.stop_strings and (stop := self.new_stop_string(seq)) is not None:
            text = decode_ids(self.tokenizer, seq.output_ids, seq.params.skip_special_tokens)
            # SGLang cuts the text at the stop string, or after it with no_stop_trim (one whole decode, at the end)
            seq.text = text[: text.index(stop) + (len(stop) if seq.params.no_stop_trim else 0)]
            return FinishReason(type="stop", matched=stop)
        if self.ends_by_length(seq):
            return FinishReason(type="length", length=len(seq.output_ids))
        return None

    def ends_by_length(self, seq: Sequence, ahead: int = 0) -> bool:
        """Whether `seq` reaches `max_new_tokens` or the context length once `ahead` more tokens are in."""
        return len(seq.output_ids) + ahead >= self.out_limit(seq)

    def out_limit(self, seq: Sequence) -> int:
        """The output tokens at which `seq` ends by length: `max_new_tokens`, or fewer where the context
        ends first (its prompt and params never change: made once, kept on it)."""
        if seq.out_limit is None:
            room = self.context_length - len(seq.prompt_ids)
            limit = seq.params.max_new_tokens
            seq.out_limit = room if limit is None else min(limit, room)
        return seq.out_limit

    def new_stop_string(self, seq: Sequence) -> str | None:
        """The first of `seq`'s stop strings (in the order given) that its text holds now that its newest
        token is in; None when none does. No stop string was in the text one token ago (it would have
        finished then), so only the text's end can hold one (see `text_a_stop_can_end_in`)."""
        stops = seq.params.stop_strings
        decode = functools.partial(decode_ids, self.tokenizer, skip_special_tokens=seq.params.skip_special_tokens)
        tail = text_a_stop_can_end_in(seq.output_ids, max(map(len, stops)), decode)
        return next((stop for stop in stops if stop in tail), None)


# A window of tokens can start inside a character: its first token's continuation bytes decode to up to
# three U+FFFD (the whole text has the one character there), and some decoders drop a first token's
# leading space. Past this many characters the window's text is the whole text's.
WINDOW_EDGE_CHARS = 4


def text_a_stop_can_end_in(ids: list[int], longest: int, decode: Callable[[list[int]], str]) -> str:
    """The end of the text of `ids` in which any string of at most `longest` characters that the text
    of `ids[:-1]` does not hold must lie: from `longest - 1` characters before the first character the
    newest token changed (or added) on. Decodes only a window of trailing tokens, twice (with and
    without the newest), so the work per token is bounded by `longest` and not by the output's length
    (decoding the whole output each token made long outputs quadratic); the window doubles while it is
    too short to reach WINDOW_EDGE_CHARS characters before that point (tokens that decode to nothing,
    bytes of one character), and is the whole output at most."""
    count = longest + WINDOW_EDGE_CHARS + 2  # a token usually decodes to a character or more
    while True:
        window = ids[-count:]
        now, before = decode(window), decode(window[:-1])
        changed = next((i for i, (a, b) in enumerate(zip(now, before)) if a != b), min(len(now), len(before)))
        start = changed - max(longest - 1, 0)
        if count >= len(ids):  # the whole output: its text exactly
            return now[max(start, 0) :]
        if start >= WINDOW_EDGE_CHARS:
            return now[start:]
        count *= 2


def record_token(
    seq: Sequence, token: int, logprob: float | None, top: Row | None, chosen: Row | None, stops: StopRules
) -> None:
    """Record `seq`'s newest token (sampled on the device, sampling.py) and its logprobs, and set
    `seq.finish` when it stops; a stream's listener hears of every unfinished step."""
    seq.output_ids.append(token)
    seq.logprobs.append(logprob)
    if top is not None:
        seq.record.output_top.append(top)
    if chosen is not None:
        seq.record.output_chosen.append(chosen)
    seq.finish = stops.finish_reason(seq, token)
    if seq.on_token is not None and seq.finish is None:  # the finished answer comes from the future
        seq.on_token(seq)
