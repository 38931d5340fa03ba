"""One step of the running batch, on tp rank 0: the model's forward (a prefill of every sequence, or
one decode token each; `lockstep` runs it on every rank), then the next token of every sequence,
sampled on the device (sampling.py), recorded with its logprobs (next_token.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from rollfleet.engine.lockstep import Action
from rollfleet.engine.logprobs import prefill_keep, take_input_logprobs
from rollfleet.engine.next_token import StopRules, record_token
from rollfleet.engine.sampling import Sampler
from rollfleet.engine.sequence import Sequence, record_routes


def advance_batch(
    running: list[Sequence],
    *,
    prefill: bool,
    lora_name: str | None,
    lockstep: Callable[..., Any],
    sampler: Sampler,
    stops: StopRules,
    read_routes: Callable[[], torch.Tensor | None],
) -> int:
    """Advance every sequence of `running` by one token; returns the bytes that crossed from the
    model's device to the host (the sampled ids and the logprobs asked for)."""
    batch = {"lora_name": lora_name, "capture_routes": any(s.routes_start is not None for s in running)}
    moved = 0
    if prefill:
        keep = prefill_keep(running)
        for seq in running:
            seq.routes.clear()  # a (re)prefill reads every position again: its routes replace any kept
        logits = lockstep(Action.PREFILL, prompts=[s.prefill_ids for s in running], keep=keep, **batch)
        if keep > 1:
            logits, moved = take_input_logprobs(running, logits)
    else:
        logits = lockstep(Action.DECODE, tokens=[s.output_ids[-1] for s in running], **batch)
    if batch["capture_routes"]:
        record_routes(running, read_routes())
    sampled = sampler.sample(logits, [seq.sampling_row(stops.stop_ids) for seq in running])
    for i, seq in enumerate(running):
        record_token(seq, sampled.tokens[i], sampled.logprobs[i], sampled.top[i], sampled.chosen[i], stops)
    return moved + sampled.host_bytes
