"""How a sample takes its next token, and when it stops, as SGLang decides it: a stop token (EOS
unless `ignore_eos`, and `stop_token_ids`; none before `min_new_tokens`), a stop string,
`max_new_tokens`, or the model's context length."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rollfleet.engine.logprobs import fill_output
from rollfleet.engine.sampling import sample_token
from rollfleet.engine.sequence import Sequence
from rollfleet.wire.protocol import FinishReason


@dataclass(frozen=True)
class StopRules:
    eos_token_ids: frozenset[int]
    context_length: int
    tokenizer: object

    def stop_ids(self, seq: Sequence) -> set[int]:
        ids = set(seq.params.stop_token_ids or [])
        return ids if seq.params.ignore_eos else ids | self.eos_token_ids

    def finish_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        """Why `seq` finishes with `token`, its newest output token (None: it goes on). A matched stop
        string also sets the sample's text."""
        if token in self.stop_ids(seq):
            return FinishReason(type="stop", matched=token)
        if seq.params.stop_strings:
            text = self.tokenizer.decode(seq.output_ids, skip_special_tokens=seq.params.skip_special_tokens)
            for stop in seq.params.stop_strings:
                if stop in text:  # SGLang cuts the text at the stop string, or after it with no_stop_trim
                    seq.text = text[: text.index(stop) + (len(stop) if seq.params.no_stop_trim else 0)]
                    return FinishReason(type="stop", matched=stop)
        if seq.params.max_new_tokens is not None and len(seq.output_ids) >= seq.params.max_new_tokens:
            return FinishReason(type="length", length=len(seq.output_ids))
        if len(seq.prompt_ids) + len(seq.output_ids) >= self.context_length:
            return FinishReason(type="length", length=len(seq.output_ids))
        return None


def advance(seq: Sequence, logits: torch.Tensor, logprobs: torch.Tensor, stops: StopRules) -> None:
    """Sample `seq`'s next token from its row of logits, record it and its logprobs, and set
    `seq.finish` when it stops; a stream's listener hears of every unfinished step."""
    if len(seq.output_ids) < seq.params.min_new_tokens:
        logits = logits.clone()
        logits[list(stops.stop_ids(seq))] = float("-inf")
    token = sample_token(logits, seq.params, seq.generator)
    seq.output_ids.append(token)
    seq.logprobs.append(float(logprobs[token]))
    fill_output(seq.record, logprobs, seq.ask)
    seq.finish = stops.finish_reason(seq, token)
    if seq.on_token is not None and seq.finish is None:  # the finished answer comes from the future
        seq.on_token(seq)
