"""Which waiting requests the paged pool admits (a mixin of PagedBatches, kv/steps.py): a new batch of
one adapter's requests, or the requests that join a running one, as many as the free pages hold
(the pages their prompts want, a sibling of an admitted prompt one page: it forks the prompt's)."""

from __future__ import annotations

from collections import deque

from rollfleet.engine.sequences.admission_batch import without
from rollfleet.engine.sequences.sequence import Sequence


class PagedAdmission:
    """Needs from PagedBatches: `blocks` (kv/blocks.py's BlockPool)."""

    def new_batch(self, waiting: deque[Sequence], max_running: int):
        lora = waiting[0].lora_name
        batch = self._fitting([s for s in waiting if s.lora_name == lora], max_running, reserve=0)
        return lora, batch, without(waiting, batch)

    def joiners(self, running: list[Sequence], waiting: deque[Sequence], lora, max_running: int) -> list[Sequence]:
        room = max_running - len(running)
        if room <= 0 or not waiting:
            return []
        pending = sum(self._pages_wanted(s) for s in running if not s.pages and s.fork_of is None)
        return self._fitting([s for s in waiting if s.lora_name == lora], room, reserve=pending)

    def _fitting(self, candidates: list[Sequence], room: int, reserve: int) -> list[Sequence]:
        """The first `room` candidates whose prompts fit in the free pages (at least one, when the
        pool holds nothing: a request the whole pool cannot hold fails at its step, with the reason)."""
        taken, left, prompts = [], self.blocks.available - reserve, set()
        for seq in candidates[:room]:
            shared = id(seq.prompt_ids) in prompts and not seq.output_ids  # a sibling forks its pages
            need = 1 if shared else self._pages_wanted(seq)
            if need > left and (taken or self.blocks.available < self.blocks.usable):
                break
            taken.append(seq)
            left -= need
            prompts.add(id(seq.prompt_ids))
        return taken

    def _pages_wanted(self, seq: Sequence) -> int:
        return self.blocks.pages_for(len(seq.prompt_ids) + len(seq.output_ids) + 1)
