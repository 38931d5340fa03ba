"""Which waiting requests run: a new batch when none runs, and which join the running one.

A batch runs with one LoRA adapter (or none): a new batch takes the waiting requests of the oldest
waiting one's adapter, in arrival order, up to `max_running_requests`. Waiting requests of the
running batch's adapter join it while there is room and recomputing the batch's output so far
(a join re-prefills the whole batch, as after a weight update) costs no more than the joiners' own
prefill: requests that arrive together (a GRPO step's prompts, sent one request each, reach the
engine over a few milliseconds) run as one batch, and a request that comes late in a long batch
waits for the next one instead of making the whole batch recompute.
"""

from __future__ import annotations

from collections import deque

from rollfleet.engine.sequences.sequence import Sequence


def new_batch(waiting: deque[Sequence], max_running: int) -> tuple[str | None, list[Sequence], deque[Sequence]]:
    """(the batch's adapter, the batch, the requests left waiting)."""
    lora = waiting[0].lora_name
    batch = [seq for seq in waiting if seq.lora_name == lora][:max_running]
    return lora, batch, without(waiting, batch)


def joiners(running: list[Sequence], waiting: deque[Sequence], lora: str | None, max_running: int) -> list[Sequence]:
    """The waiting requests that join the running batch now (none, most of the time)."""
    room = max_running - len(running)
    if room <= 0 or not waiting:
        return []
    joining = [seq for seq in waiting if seq.lora_name == lora][:room]
    recompute = sum(len(seq.output_ids) for seq in running)
    return joining if joining and recompute <= sum(len(seq.prefill_ids) for seq in joining) else []


def without(waiting: deque[Sequence], taken: list[Sequence]) -> deque[Sequence]:
    ids = {id(seq) for seq in taken}
    return deque(seq for seq in waiting if id(seq) not in ids)
