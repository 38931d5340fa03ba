"""Aborting requests in the embedded engine's scheduler (SGLang's /abort_request, pause mode
"abort", a weight update that aborts first): a mixin of `Scheduler`, which owns the queues.

An aborted request is only marked here; the engine thread finishes it (as `finish_reason.type ==
"abort"` with the message) at its next step, so a batch never changes shape under a forward pass.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

from rollfleet.engine.sequences.sequence import Sequence
from rollfleet.wire.protocol import FinishReason


class Aborts:
    """Needs from the scheduler: `_wakeup` (its condition), `waiting`, `running`, `_retire_finished`, `_finish`."""

    # set (under `_wakeup`) when a request is marked, cleared once the running ones are finished: a
    # step with nothing marked skips the scans of the running set for marks (several a step)
    aborts_marked: bool = False

    def abort(self, rid: str = "", abort_all: bool = False, message: str = "aborted by request") -> int:
        def matches(seq: Sequence) -> bool:
            return abort_all or seq.rid == rid or seq.rid.startswith(f"{rid}-")

        with self._wakeup:
            count = self._abort_matching(matches, message)
            self._wakeup.notify()
        return count

    def abort_sequences(self, seqs: list[Sequence], message: str) -> int:
        """Abort these sequences (not others whose rid merely starts the same)."""
        ids = {id(seq) for seq in seqs}
        with self._wakeup:
            count = self._abort_matching(lambda seq: id(seq) in ids, message)
            self._wakeup.notify()
        return count

    def _drop_aborted_running(self) -> None:
        with self._wakeup:
            for seq in self.running if self.aborts_marked else ():
                if seq.abort_message is not None:
                    seq.finish = FinishReason(type="abort", message=seq.abort_message)
            self.aborts_marked = False  # the waiting ones left when they were marked (_abort_matching)
            if any(seq.finish for seq in self.running):
                self._retire_finished()

    def _drop_aborted_waiting(self) -> None:
        for seq in [s for s in self.waiting if s.abort_message is not None]:
            self.waiting.remove(seq)
            self._finish(seq, FinishReason(type="abort", message=seq.abort_message))

    def _abort_matching(self, matches: Callable[[Sequence], bool], message: str) -> int:
        count = 0
        for seq in itertools.chain(self.waiting, self.running):
            if matches(seq) and seq.abort_message is None:
                seq.abort_message = message
                count += 1
        self.aborts_marked = self.aborts_marked or count > 0
        self._drop_aborted_waiting()
        return count
