"""Which prompts of the endless shuffled stream a run has used, so none is lost or used twice.

Position p of the stream is `dataset.batch(p, 1, seed=...)[0]`: the synchronous loop's step s uses
positions s*P .. (s+1)*P - 1 (P = prompts_per_step). An asynchronous run hands positions out ahead
of the trainer and uses them out of order (a group dropped as too stale is generated again; dynamic
sampling uses more than P per step), so it records what it used: every position below
`consumed_below`, and the ones in `consumed` above it. That record is saved with the trainer state;
after a resume every position not in it is generated again, including those that were queued or
being generated at the checkpoint.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable

from rollfleet.train.invariants import LostOrDuplicatedSamples


class PromptCursor:
    def __init__(self, consumed_below: int = 0, consumed: Iterable[int] = ()):
        self.consumed_below = consumed_below
        self.consumed = {p for p in consumed if p >= consumed_below}
        self._next = consumed_below  # the next fresh position to hand out
        self._again: deque[int] = deque()  # handed out, given back: handed out again first
        self._lock = threading.Lock()

    @classmethod
    def from_state(cls, state: dict | None, step: int, prompts_per_step: int) -> PromptCursor:
        """The cursor a checkpoint saved, or (a state written by a synchronous run, or none) the
        synchronous loop's position at `step`."""
        if not state:
            return cls(step * prompts_per_step)
        return cls(int(state["consumed_below"]), (int(p) for p in state["consumed"]))

    def at_step(self, step: int, prompts_per_step: int) -> bool:
        """Whether this record is exactly what the synchronous loop has used before `step` (its
        positions step*P .. come next); a run may then go on synchronously from it."""
        with self._lock:
            return self.consumed_below == step * prompts_per_step and not self.consumed

    def state(self) -> dict:
        with self._lock:
            return {"consumed_below": self.consumed_below, "consumed": sorted(self.consumed)}

    def hand_out(self, count: int) -> list[int]:
        """`count` positions not consumed and not handed out: given-back ones first, then fresh ones."""
        with self._lock:
            out = [self._again.popleft() for _ in range(min(count, len(self._again)))]
            while len(out) < count:
                if self._next not in self.consumed:
                    out.append(self._next)
                self._next += 1
            return out

    def give_back(self, position: int) -> None:
        """A handed-out position whose group was dropped unused: it is handed out again."""
        with self._lock:
            self._again.append(position)

    def consume(self, position: int) -> None:
        """`position` is used (trained on, or dropped for good); it is never handed out again."""
        with self._lock:
            if position < self.consumed_below or position in self.consumed:
                raise LostOrDuplicatedSamples(f"prompt position {position} would be used twice")
            self.consumed.add(position)
            while self.consumed_below in self.consumed:
                self.consumed.remove(self.consumed_below)
                self.consumed_below += 1
