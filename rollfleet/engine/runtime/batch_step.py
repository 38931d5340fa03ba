"""One step of the running batch, on tp rank 0: the model's forward (a prefill of every sequence, or
one decode token each; `lockstep` runs it on every rank), then the next token of every sequence,
sampled on the device (sampling.py), recorded with its logprobs (next_token.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from rollfleet.engine.kv.steps import StepOutcome
from rollfleet.engine.sequences import admission_batch
from rollfleet.engine.sequences.logprobs import prefill_keep, take_input_logprobs
from rollfleet.engine.sequences.next_token import StopRules, record_token
from rollfleet.engine.sequences.sampling import Sampler
from rollfleet.engine.sequences.sequence import Sequence, record_routes
from rollfleet.engine.tp.lockstep import Action


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


class DenseBatches:
    """The scheduler's batches over transformers' own cache, left-padded (models the paged pool does
    not serve, and the tests that compare the two): a new or joined batch prefills every sequence,
    and finished ones leave it by `keep_rows`. The same interface as kv/steps.py's PagedBatches."""

    joins_recompute = True
    inflight = None  # no step stays in flight (kv/overlap.py is the paged pool's)

    def __init__(self, *, lockstep, sampler: Sampler, stops: StopRules, read_routes):
        self.lockstep, self.sampler, self.stops, self.read_routes = lockstep, sampler, stops, read_routes

    def new_batch(self, waiting, max_running: int):
        return admission_batch.new_batch(waiting, max_running)

    def joiners(self, running, waiting, lora, max_running: int):
        return admission_batch.joiners(running, waiting, lora, max_running)

    def advance(self, running: list[Sequence], recompute: bool, lora_name: str | None, overlap=False) -> StepOutcome:
        recomputed = sum(1 for seq in running if seq.output_ids) if recompute else 0
        prefilled = sum(len(seq.prefill_ids) for seq in running) if recompute else 0
        moved = advance_batch(
            running,
            prefill=recompute,
            lora_name=lora_name,
            lockstep=self.lockstep,
            sampler=self.sampler,
            stops=self.stops,
            read_routes=self.read_routes,
        )
        return StepOutcome(
            host_bytes=moved, sampled=len(running), recomputed=recomputed, prefill_tokens=prefilled, prefill=recompute
        )

    def retire(self, running: list[Sequence], keep: list[int]) -> None:
        if not keep:
            self.lockstep(Action.END_BATCH)
        elif len(keep) < len(running):
            self.lockstep(Action.KEEP_ROWS, rows=keep)

    def drop(self, seqs: list[Sequence]) -> None:
        self.lockstep(Action.END_BATCH)

    def settle(self, outcome: StepOutcome) -> None:
        pass

    def flush(self) -> None:
        pass
