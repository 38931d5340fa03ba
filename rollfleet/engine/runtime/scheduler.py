"""Batching and request lifecycle of the embedded engine, on tp rank 0.

One engine thread owns the model. It runs, in this order of priority:
  1. control actions (weight updates, memory release, ...); an action that needs an idle
     engine waits until the running batch ends, unless generation is paused in place; an
     action with `waits_for` (unloading a LoRA adapter) waits until no unfinished request
     matches it;
  2. one step of the running batch (every request in it advances one token), which waiting
     requests of its adapter may join first (admission_batch.py says when);
  3. a new batch of waiting requests of one adapter (admission_batch.py), once the requests the
     HTTP side is still reading are queued too, or the wait for them is over (arrivals.py).
Every model call goes through `lockstep` (lockstep.py), which broadcasts it to the other tp
ranks first, so all ranks execute the same actions in the same order.

Pausing, holding and refusing are pausing.py's (a mixin); stepping a paused engine is stepping.py's;
how requests end (finished, or their batch failed) finishing.py's; when a decode step's draws may
stay on the device past it, overlapping.py's.

The loop outlives any one request: requests are checked before they are queued
(`check_request`), and an exception while a batch runs finishes that batch's requests with
`finish_reason.type == "abort"` and the reason, then the loop takes the next work. Only a
failure of the loop itself stops it; then every pending caller fails at once and
`dead_reason` says why (the server's `/health` answers 503 with it).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch

from rollfleet.engine.runtime.aborts import Aborts
from rollfleet.engine.runtime.admission import check_request
from rollfleet.engine.runtime.arrivals import Arrivals
from rollfleet.engine.runtime.batch_step import DenseBatches
from rollfleet.engine.runtime.finishing import Finishing
from rollfleet.engine.runtime.overlapping import Overlapping
from rollfleet.engine.runtime.pausing import Pausing
from rollfleet.engine.runtime.stepping import Stepping
from rollfleet.engine.sequences.admission_batch import without
from rollfleet.engine.sequences.logprobs import LogprobAsk
from rollfleet.engine.sequences.next_token import StopRules
from rollfleet.engine.sequences.sampling import Sampler
from rollfleet.engine.sequences.sequence import (
    ControlAction,
    Sequence,
    mark_version_change,
    sample_group,
)
from rollfleet.wire.protocol import FinishReason, SamplingParams

log = logging.getLogger("rollfleet.engine")
# cumulative; host_bytes: what crossed from the model's device to the host for sampling and logprobs
STATS = ("batches", "joined", "largest_batch", "generated_tokens", "recomputed_prefixes", "host_bytes")
STATS += ("preempted", "prefill_tokens")  # the paged pool's: pages run out; tokens fed by prefill steps
STATS += ("prefill_steps", "decode_steps", "prefill_seconds", "decode_seconds")  # steps, and their wall time
STATS += ("device_wait_seconds", "device_waits")  # the host blocked for a step's draws: seconds, steps
STATS += ("texts_ahead_pieces",)  # samples' texts decoded in pieces before their end (finishing.py)
# time.monotonic() at the last batch's first step, last step's end, retire, texts, answers (finishing.py)
CLOCK = ("batch_began_at", "steps_ended_at", "retired_at", "decoded_at", "answered_at")
IDLE_WAKE_S = 0.5  # an idle engine thread looks again this often (a notify wakes it first)


class EngineStopped(RuntimeError):
    """The engine loop has stopped: nothing more can run on this engine."""


class Scheduler(Aborts, Finishing, Overlapping, Pausing, Stepping):
    def __init__(
        self,
        lockstep: Callable[..., Any],
        tokenizer,
        *,
        eos_token_ids: set[int],
        context_length: int,
        max_running_requests: int,
        weight_version: str,
        vocab_size: int,
        max_samples_per_request: int = 1024,
        thread_setup: Callable[[], None] = lambda: None,
        read_routes: Callable[[], torch.Tensor | None] = lambda: None,  # the last forward's routes (rank 0)
        batches: Callable[..., Any] | None = None,  # PagedBatches(**parts) (kv/steps.py); None: DenseBatches
        arrival_wait_s: float = 0.0,  # how long an idle engine waits for requests still being read
    ):
        self.lockstep = lockstep
        self.tokenizer = tokenizer
        self.context_length = context_length
        self.stops = StopRules(frozenset(eos_token_ids), context_length, tokenizer)
        self.max_running_requests = max_running_requests
        self.vocab_size = vocab_size
        self.max_samples_per_request = max_samples_per_request
        self._weight_version = weight_version
        self.thread_setup = thread_setup  # per-thread state the model needs (the current CUDA device)
        self.read_routes = read_routes
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.needs_prefill = False
        self.batch_lora: str | None = None  # the LoRA adapter of the running batch
        self.controls: deque[ControlAction] = deque()
        self.paused = False
        self.pause_mode: str | None = None
        self._pause_settled: list[Future] = []  # pause calls waiting for the engine thread to act
        self.held: str | None = None  # why no batch may run now (a sync in progress)
        self.refusing: str | None = None  # why requests are refused now (mixed weights)
        self.stopped = False
        self.failure: BaseException | None = None
        self.sampler = Sampler()
        parts = {"lockstep": lockstep, "sampler": self.sampler, "stops": self.stops, "read_routes": read_routes}
        self.batches = (batches or DenseBatches)(**parts)  # how a step runs, who joins, how KV is kept
        self.stats = dict.fromkeys(STATS, 0)
        self.clock = dict.fromkeys(CLOCK, 0.0)
        self._wakeup = threading.Condition()
        self.arrivals = Arrivals(self._wakeup, arrival_wait_s)
        self._thread = threading.Thread(target=self._loop, name="rollfleet-engine", daemon=True)

    # ---- called from the HTTP side (any thread) ------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def check_request(self, prompts: list[list[int]], params: list[SamplingParams], field: str = "input_ids") -> None:
        """ValueError naming the field, the value and the fix for what the model cannot take (admission.py)."""
        check_request(
            prompts,
            params,
            field,
            vocab_size=self.vocab_size,
            max_samples=self.max_samples_per_request,
            eos_token_ids=self.stops.eos_token_ids,
        )

    def submit(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        rid: str | None,
        return_logprob: bool,
        lora_name: str | None = None,
        ask: LogprobAsk | None = None,
        routes_start: int | None = None,
    ) -> list[Sequence]:
        seqs = sample_group(
            prompt_ids, params, rid or uuid.uuid4().hex, return_logprob, lora_name, ask or LogprobAsk(), routes_start
        )
        with self._wakeup:
            self._raise_if_dead()
            if self.refusing is not None:
                raise RuntimeError(self.refusing)
            for seq in seqs:
                if params.max_new_tokens == 0:
                    self._finish(seq, FinishReason(type="length", length=0))
                else:
                    self.waiting.append(seq)
            self._wakeup.notify()
        return seqs

    def submitting(self) -> threading.Condition:  # held around a request's submits: one batch for all
        return self._wakeup

    def control(
        self,
        fn: Callable[[], Any],
        *,
        needs_idle: bool = True,
        abort_first: bool = False,
        waits_for: Callable[[Sequence], bool] | None = None,
    ) -> Future:
        action = ControlAction(fn, needs_idle, waits_for)
        with self._wakeup:
            self._raise_if_dead()
            if abort_first:
                self._abort_matching(lambda seq: True, "aborted for a weight update")
            self.controls.append(action)
            self._wakeup.notify()
        return action.future

    @property
    def weight_version(self) -> str:
        return self._weight_version

    @weight_version.setter
    def weight_version(self, version: str) -> None:
        """A new label marks where the old version's tokens end in every unfinished request."""
        with self._wakeup:
            if version != self._weight_version:
                mark_version_change(itertools.chain(self.waiting, self.running), self._weight_version)
            self._weight_version = version

    def weights_changed(self) -> None:
        """Weights were replaced under a paused running batch (engine thread): its KV cache is the old
        weights', so the batch recomputes it (prefill over prompt + output) before its next token."""
        if self.running:
            self.needs_prefill = True

    @property
    def live_stats(self) -> dict[str, int | bool | str | None]:
        """The cumulative stats, the requests and control actions there are now, and what halts the engine."""
        with self._wakeup:
            now = {"running_requests": len(self.running), "waiting_requests": len(self.waiting)}
            halts = {"paused": self.paused, "held": self.held, "steps_left": self.steps_left}
            # waves an idle engine held back for requests still being read, and for how long (arrivals.py)
            arrivals = {"arrival_holds": self.arrivals.holds, "arrival_hold_seconds": self.arrivals.held_s}
            arrivals["arriving_requests"] = self.arrivals.reading  # being read by the HTTP side now
            return {**self.stats, **self.clock, **arrivals, **now, "queued_controls": len(self.controls), **halts}

    @property
    def dead_reason(self) -> str | None:
        """Why this engine cannot generate any more (None while the loop runs or was stopped on purpose)."""
        if self.failure is not None:
            return f"the engine loop has stopped: {self.failure!r}"
        if self._thread.ident is not None and not self._thread.is_alive() and not self.stopped:
            return "the engine loop thread has exited"
        return None

    def unfinished_rids(self) -> set[str]:
        with self._wakeup:
            return {seq.rid for seq in itertools.chain(self.waiting, self.running)}

    @property
    def num_unfinished(self) -> int:
        with self._wakeup:  # not while the engine thread moves requests between its lists
            return len(self.waiting) + len(self.running)

    def stop(self) -> None:
        with self._wakeup:
            self.stopped = True
            self._wakeup.notify()
        self._thread.join(timeout=10)

    # ---- engine thread ----------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            self.thread_setup()
            while True:
                with self._wakeup:
                    work = self._next_work()
                    while work is None and not self.stopped:
                        self._wakeup.wait(timeout=self.arrivals.wait_timeout(IDLE_WAKE_S))
                        work = self._next_work()
                    if self.stopped:
                        break
                work()
        except BaseException as exc:  # the engine cannot go on: fail every caller instead of hanging
            with self._wakeup:
                self.failure = exc
                self._fail_everything(exc)
            raise

    def _next_work(self) -> Callable[[], None] | None:
        self._drop_aborted_waiting()
        if self.batches.inflight is not None and not self._may_overlap():
            return self._settle  # a decode step's draws are still on the device (kv/overlap.py)
        self._settle_steps()
        if self._pause_settled:
            return self._settle_pause
        if self.controls and self._can_run(self.controls[0]):
            action = self.controls.popleft()
            return lambda: self._run_control(action)
        if self._aborted_running():
            return self._drop_aborted_running  # aborts take effect at once, paused or not
        if self.running and self._take_step():
            joining = self._joiners()
            if joining and not self.controls and not self.halted:
                self.running, self.waiting = [*self.running, *joining], without(self.waiting, joining)
                self.needs_prefill |= self.batches.joins_recompute  # dense: a prefill of all with them
                self.stats["joined"] += len(joining)
            return self._step
        if self.waiting and not self.halted and self.arrivals.hold_back():
            return None  # an arrival wave: its other requests are still being read
        if self.waiting and self._take_step():
            self.arrivals.over()
            batch = self.batches.new_batch(self.waiting, self.max_running_requests)
            self.batch_lora, self.running, self.waiting = batch
            self.needs_prefill = self.batches.joins_recompute
            self.stats["batches"] += 1
            self.clock["batch_began_at"] = time.monotonic()
            return self._step
        return None

    def _aborted_running(self) -> bool:
        return self.aborts_marked and any(seq.abort_message is not None for seq in self.running)

    def _joiners(self) -> list[Sequence]:
        return self.batches.joiners(self.running, self.waiting, self.batch_lora, self.max_running_requests)

    def _can_run(self, action: ControlAction) -> bool:
        if action.needs_idle and self.running and not self.halted:
            return False
        return action.waits_for is None or not any(map(action.waits_for, itertools.chain(self.waiting, self.running)))

    def _run_control(self, action: ControlAction) -> None:
        # No flush after it: the prefix cache is keyed by the weights' generation and the adapter's
        # load (kv/steps.py), so a control that changed either leaves nothing that matches.
        try:
            action.future.set_result(action.fn())
        except Exception as exc:  # reported to the caller (an HTTP 400), the engine goes on
            action.future.set_exception(exc)

    def _step(self) -> None:
        self._drop_aborted_running()
        if not self.running:
            return
        try:
            self._advance_batch()
        except Exception as exc:  # the batch's requests fail with the reason; the engine goes on
            self._fail_batch(exc)

    def _advance_batch(self) -> None:
        self.stats["largest_batch"] = max(self.stats["largest_batch"], len(self.running))
        began = time.perf_counter()
        outcome = self.batches.advance(self.running, self.needs_prefill, self.batch_lora, self._may_overlap())
        self.needs_prefill = False
        self._account(outcome, began)

    def _account(self, outcome, began: float) -> None:
        """A step's (or a settle's) figures into the stats, then its finished requests retire."""
        kind = "prefill" if outcome.prefill else "decode"
        self.stats[f"{kind}_steps"] += outcome.launched
        self.stats[f"{kind}_seconds"] += time.perf_counter() - began
        self.clock["steps_ended_at"] = time.monotonic()
        outcome.add_to(self.stats)
        with self._wakeup:
            if outcome.preempted:  # out of KV pages: they wait again, first in line, their KV recomputed
                gone = {id(seq) for seq in outcome.preempted}
                self.running = [seq for seq in self.running if id(seq) not in gone]
                self.waiting.extendleft(reversed(outcome.preempted))
                self.stats["preempted"] += len(outcome.preempted)
            self._retire_finished()
        self._decode_ahead(outcome.prefill)

    def _raise_if_dead(self) -> None:
        if self.failure is not None:
            raise EngineStopped(f"the engine loop has stopped: {self.failure!r}")

    def _fail_everything(self, exc: BaseException) -> None:
        error = EngineStopped(f"the engine loop has stopped: {exc!r}")
        for seq in itertools.chain(self.waiting, self.running):
            self._finish(seq, FinishReason(type="abort", message=str(error)))
        for future in [*(action.future for action in self.controls), *self._pause_settled]:
            future.set_exception(error)
        self._fail_steps(error)
        self.waiting.clear(), self.running.clear(), self.controls.clear(), self._pause_settled.clear()
