"""When a decode step's draws may stay on the device past it (the overlapped decode step,
kv/overlap.py): a mixin of `Scheduler`.

The engine thread asks before every step (`_may_overlap`); while a step is in flight it asks again
before picking its next work, and records that step first (`_settle`) when anything is waiting to
act between steps: a pause, a control that may run now, an abort, requests that may join, a halt
(a paused engine's granted steps each end with their tokens recorded, as without the overlap), or
a batch that ended.
"""

from __future__ import annotations

import time

from rollfleet.engine.kv.steps import StepOutcome


class Overlapping:
    """Needs from the scheduler: `running`, `waiting`, `controls`, `halted`, `stopped`,
    `needs_prefill`, `_pause_settled`, `batches`, `_can_run`, `_aborted_running`, `_joiners`,
    `_account`, `_fail_batch`."""

    def _may_overlap(self) -> bool:
        """Whether this step's draws may stay on the device past it: nothing is waiting to act
        between steps and the batch goes on."""
        if not self.running or self.halted or self.stopped or self.needs_prefill or self._pause_settled:
            return False
        if (self.controls and self._can_run(self.controls[0])) or self._aborted_running():
            return False
        return not (self.waiting and self._joiners())

    def _settle(self) -> None:
        """Record the step in flight (its finished requests retire and are answered)."""
        began, outcome = time.perf_counter(), StepOutcome(launched=False)
        try:
            self.batches.settle(outcome)
        except Exception as exc:  # the batch's requests fail with the reason; the engine goes on
            self._fail_batch(exc)
            return
        self._account(outcome, began)
