"""The overlapped decode step (SGLang's overlap scheduler), on tp rank 0 of a tp-1 engine: while the
device runs decode step t+1, the host records step t's tokens, checks their stops and answers
finished requests. A mixin of PagedBatches (kv/steps.py).

Without it a decode step waits for its draws to reach the host, then records them (3-4 us a row:
1.8 ms a step at 512 rows), then builds the next step's inputs, and the device idles through all of
that. With it, a steady decode step's draws stay on the device (`inflight`), and the next step is
launched fed with them (`ids`: kv/paged.py) before the host reads them:

    launch t+1 (fed t's draws on the device)  ->  read and record t's draws  ->  return

so the host's work of step t runs beside the device's step t+1. A row's KV then holds its newest
recorded token, whose successor is in flight (`kv_len` is prompt + output, one more than a row
waiting for its decode step). A row that finishes when step t is recorded was fed once more in
step t+1 (a stop token or string is seen one step late): that step's draw for it is thrown away,
and what it wrote is the KV of its last token, which is right. Rows that will end by their length
when t is recorded (`max_new_tokens`, the context) are left out of t+1, so a batch that ends by
length (GRPO's usual rollouts) runs no step more than it needs.

The step in flight is recorded first (`settle`, the scheduler's) whenever anything acts between
steps: requests joining, a control, a pause, an abort, a halt, a weight change; a step that cannot
be launched before the host has read the last one (a row out of pages: it may preempt; a row new to
the set) records the last one and launches nothing. Prefill steps, route capture and tp > 1 (the
followers would need the draws) do not overlap. On a CPU the device is the host, so nothing runs
beside anything, but the same code runs, so CPU tests check its bookkeeping.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rollfleet.engine.sequences.device_copy import to_device
from rollfleet.engine.sequences.draws import Drawn, Joined
from rollfleet.engine.sequences.next_token import record_token
from rollfleet.engine.sequences.sampling import same_objects
from rollfleet.engine.sequences.sequence import Sequence
from rollfleet.engine.tp.lockstep import Action


@dataclass
class InFlight:
    seqs: list[Sequence]  # the step's rows, in order
    drawn: Drawn | Joined  # their draws, on the device
    written: list[int]  # each row's tokens of KV once the step has run


class Overlap:
    """Needs from PagedBatches: `blocks`, `lockstep`, `sampler`, `stops`, `copies`, `epoch`,
    `kv_epoch`, `generation`, `weights_generation`, `_grow`. `overlap`: whether this engine may
    overlap at all (setup.py: tp 1 and no --disable-overlap-schedule)."""

    overlap: bool = False
    inflight: InFlight | None = None

    def settle(self, outcome) -> None:
        """Record the step in flight, if any (before anything acts between steps)."""
        previous, self.inflight = self.inflight, None
        if previous is not None:
            self._record(previous, outcome)

    def _keep_flying(self, running: list[Sequence], fresh: bool, lora_name: str | None, outcome) -> None:
        """Launch the next step of `running` when it may run now (`fresh`: nothing changed under the
        rows since the step in flight), then record the step in flight."""
        previous, self.inflight = self.inflight, None
        if fresh and self.epoch == self.kv_epoch() and self.generation == self.weights_generation():
            self.inflight = self._launch_next(running, lora_name, previous)
        outcome.launched = self.inflight is not None
        self._record(previous, outcome)

    def _launch_next(self, running: list[Sequence], lora_name: str | None, previous: InFlight) -> InFlight | None:
        """Step t+1 of `running`, fed the draws of step t (`previous`, still on the device); None when
        it cannot run before they are read: a row not in step t, a row out of pages, or no row that
        goes on after step t."""
        same = same_objects(running, previous.seqs)
        where = None if same else {id(seq): row for row, seq in enumerate(previous.seqs)}
        if where is not None and any(id(seq) not in where for seq in running):
            return None
        going = [seq for seq in running if not self.stops.ends_by_length(seq, ahead=1)]
        page = self.blocks.page_size
        for seq in going:
            if seq.kv_len >= len(seq.pages) * page and not self._grow(seq, seq.kv_len + 1):
                return None  # recorded first; the next step preempts (kv/steps.py)
        if not going:
            return None
        ids = previous.drawn.tokens
        if not same or len(going) != len(running):  # the steady step feeds every row of the last, in order
            where = where or {id(seq): row for row, seq in enumerate(previous.seqs)}
            index = [where[id(seq)] for seq in going]
            if index != list(range(len(previous.seqs))):
                ids = ids[to_device(index, torch.long, ids.device)]
        copies, self.copies = self.copies, []
        logits = self.lockstep(
            Action.STEP,
            rows=[(seq.kv_len, [0], seq.pages) for seq in going],  # the tokens are `ids`
            logits_at=list(range(len(going))),
            copies=copies,
            lora_name=lora_name,
            capture_routes=False,
            ids=ids,
        )
        drawn = self.sampler.launch(logits, [seq.sampling_row(self.stops.stop_ids, ahead=1) for seq in going])
        written = []
        for seq in going:
            seq.kv_len += 1
            written.append(seq.kv_len)
        return InFlight(going, drawn, written)

    def _draw(self, samplers: list[Sequence], rows: torch.Tensor, outcome, fly: bool = False) -> None:
        """Sample `samplers` from their logits `rows`; recorded now, or left in flight (`fly`)."""
        asks = [seq.sampling_row(self.stops.stop_ids) for seq in samplers]
        step = InFlight(samplers, self.sampler.launch(rows, asks), [seq.kv_len for seq in samplers])
        if fly:
            self.inflight = step
        else:
            self._record(step, outcome)

    def _record(self, step: InFlight, outcome) -> None:
        """The step's draws on the host, recorded for every row still running (one retired or dropped
        since it was launched has its draw thrown away); the pages it filled go in the prefix cache:
        read back, the step has written their KV (a step that failed records none)."""
        outcome.device_wait += step.drawn.wait()
        sampled = step.drawn.collect()
        recorded, page, filled = 0, self.blocks.page_size if self.blocks.prefix_cache else 0, []
        rows = zip(step.seqs, step.written, sampled.tokens, sampled.logprobs, sampled.top, sampled.chosen)
        for seq, written, token, logprob, top, chosen in rows:
            if seq.finish is None and seq.pages:
                if page and written % page == 0:
                    filled.append(_filled(seq, written // page, page))
                record_token(seq, token, logprob, top, chosen, self.stops)
                recorded += 1
        if filled:
            self.blocks.record_filled(filled)
        outcome.host_bytes += sampled.host_bytes
        outcome.sampled += recorded

    def _discard(self) -> None:
        """Forget the step in flight unread (its batch failed): its rows that keep their pages wait
        for their decode step again (their newest token is fed again)."""
        previous, self.inflight = self.inflight, None
        for seq in previous.seqs if previous is not None else ():
            if seq.pages and seq.kv_len:
                seq.kv_len -= 1


def _filled(seq: Sequence, pages: int, page_size: int) -> tuple[list[int], int, list[int], str]:
    """`seq`'s pages, how many are full, the tokens of the last full one, its root (BlockPool.record_filled)."""
    end, prompt = pages * page_size, len(seq.prompt_ids)
    start = end - page_size
    if start >= prompt:
        window = seq.output_ids[start - prompt : end - prompt]
    else:
        window = seq.prompt_ids[start:end] + seq.output_ids[: max(0, end - prompt)]
    return seq.pages, pages, window, seq.kv_root
