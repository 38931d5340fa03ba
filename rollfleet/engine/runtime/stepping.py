"""Stepping a paused engine (rollfleet's `/rollfleet/step`): a mixin of `Scheduler`.

While generation is paused, `step(n)` lets the engine thread run `n` more steps, each a batch's
prefill (a new batch from the waiting requests, or a recompute after a weight change) or one decode
step of the running batch, then holds it again between steps. A test or an operator makes "a request
is still generating, with k tokens" a state to look at instead of a race against the clock: pause in
place, submit, step k, act (kill, update, abort), continue.

The answer comes once the `n` steps have run, or earlier when nothing is left to run (the batch
finished, the engine resumed); it says how many ran. Controls still run between steps, in the
scheduler's usual order. A step needs the pause alone: while a weight session holds the engine
(mixed weights) nothing may run, stepped or not.
"""

from __future__ import annotations

from concurrent.futures import Future


class Stepping:
    """Needs from the scheduler: `_wakeup` (its condition), `paused`, `held`, `halted`, `running`,
    `waiting`, `_raise_if_dead`. Sets `steps_left` and `_stepping` (the waiting call and its grant)."""

    steps_left: int = 0  # steps a paused engine may still run
    _stepping: tuple[Future, int] | None = None

    def step(self, steps: int) -> Future:
        """Let a paused engine run `steps` more steps; the future's result is how many ran."""
        if steps < 1:
            raise ValueError(f"steps={steps}: give a number of steps of 1 or more")
        done: Future = Future()
        with self._wakeup:
            self._raise_if_dead()
            if not self.paused:
                raise ValueError("the engine is not paused: pause_generation (mode in_place) first, then step")
            if self.held is not None:
                raise ValueError(f"the engine is held ({self.held}): no step may run until the weights are whole")
            if self._stepping is not None:
                raise ValueError("a step call is still running: wait for its answer before the next one")
            self._stepping, self.steps_left = (done, steps), steps
            self._wakeup.notify()
        return done

    def _take_step(self) -> bool:
        """Whether a step may run now (engine thread, under `_wakeup`); a paused engine spends one of
        the steps `step` granted."""
        if not self.halted:
            return True
        if self.steps_left > 0 and self.held is None:
            self.steps_left -= 1
            return True
        return False

    def _settle_steps(self) -> None:
        """Answer the step call once its steps ran or nothing is left to run (under `_wakeup`)."""
        if self._stepping is None:
            return
        if self.steps_left == 0 or not (self.running or self.waiting) or not self.paused:
            (done, granted), self._stepping = self._stepping, None
            ran, self.steps_left = granted - self.steps_left, 0
            if not done.done():
                done.set_result(ran)

    def _fail_steps(self, error: BaseException) -> None:
        if self._stepping is not None:
            (done, _), self._stepping = self._stepping, None
            done.set_exception(error)
