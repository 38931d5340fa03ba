"""Pausing, holding and refusing the engine: a mixin of `Scheduler` (scheduler.py).

Pausing (SGLang's /pause_generation, then /continue_generation) stops every batch; control
actions, weight updates included, run while paused, and so do the n steps of `step(n)`
(stepping.py). "abort" ends every unfinished request; "in_place" keeps the running batch;
"retract" puts it back at the head of the queue and drops its KV cache. A batch whose weights
changed under it recomputes its KV cache (a prefill over prompt + output so far) before its next
token, so every token after an update is the new weights' own (SGLang's in_place decodes on the
old cache instead). A new version label marks where the old version's tokens end in every
unfinished request (`meta_info.weight_versions`).

Two gates serve weight-update sessions (weight_session.py): `hold(reason)` keeps every request
waiting (no batch starts or steps, as if paused in place) while a session's sync is in
progress; `refuse(reason)` ends every unfinished request and refuses new ones while the weights
are mixed.
"""

from __future__ import annotations

from concurrent.futures import Future


class Pausing:
    """Needs from the scheduler: `_wakeup`, `paused`, `pause_mode`, `_pause_settled`, `held`, `refusing`,
    `running`, `waiting`, `batches`, `_raise_if_dead`, `_abort_matching`, `_drop_aborted_running`."""

    def pause(self, mode: str) -> Future:
        """Stop generating until `resume` (the module docstring says what each mode does); the
        future is done once the engine thread has acted."""
        settled: Future = Future()
        with self._wakeup:
            self._raise_if_dead()
            if mode == "abort":
                self._abort_matching(lambda seq: True, "aborted by pause_generation")
            self.paused, self.pause_mode = True, mode
            self._pause_settled.append(settled)
            self._wakeup.notify()
        return settled

    def resume(self) -> None:
        with self._wakeup:
            self.paused, self.pause_mode = False, None
            self._wakeup.notify()

    def hold(self, reason: str | None) -> None:
        """Keep every request waiting (None: let them run again)."""
        with self._wakeup:
            self.held = reason
            self._wakeup.notify()

    def refuse(self, reason: str | None) -> None:
        """End every unfinished request and refuse new ones, naming `reason` (None: accept again)."""
        with self._wakeup:
            self.refusing = reason
            if reason is not None:
                self._abort_matching(lambda seq: True, reason)
            self._wakeup.notify()

    @property
    def halted(self) -> bool:
        return self.paused or self.held is not None

    def _settle_pause(self) -> None:
        """A pause takes effect: aborted requests end; with "retract", the running batch goes back to
        the head of the queue and its KV cache is dropped (recomputed when it runs again)."""
        self._drop_aborted_running()
        with self._wakeup:
            settled, self._pause_settled = self._pause_settled, []
            retracted = self.running if self.paused and self.pause_mode == "retract" else []
            if retracted:
                self.waiting.extendleft(reversed(retracted))
                self.running = []
        if retracted:
            self.batches.drop(retracted)
        for future in settled:
            future.set_result(len(retracted))
