"""Batching and request lifecycle of the embedded engine, on tp rank 0.

One engine thread owns the model. It runs, in this order of priority:
  1. control actions (weight updates, memory release, ...); an action that needs an idle
     engine waits until the running batch ends, unless generation is paused in place; an
     action with `waits_for` (unloading a LoRA adapter) waits until no unfinished request
     matches it;
  2. one decode step of the running batch (every request in it advances one token);
  3. a new batch made of the waiting requests that use the same LoRA adapter (or none) as the
     oldest waiting one (up to `max_running_requests`): a batch runs with one adapter.
Requests that arrive while a batch runs wait for the next batch. Every model call goes
through `lockstep` (lockstep.py), which broadcasts it to the other tp ranks first, so all ranks
execute the same actions in the same order.

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
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch

from rollfleet.engine.aborts import Aborts
from rollfleet.engine.admission import check_request
from rollfleet.engine.lockstep import Action
from rollfleet.engine.logprobs import LogprobAsk, prefill_keep, take_input_logprobs
from rollfleet.engine.next_token import StopRules, advance
from rollfleet.engine.sequence import (
    ControlAction,
    Sequence,
    mark_version_change,
    record_routes,
    sample_group,
    wire_result,
)
from rollfleet.engine.stepping import Stepping
from rollfleet.wire.protocol import FinishReason, SamplingParams

log = logging.getLogger("rollfleet.engine")


class EngineStopped(RuntimeError):
    """The engine loop has stopped: nothing more can run on this engine."""


class Scheduler(Aborts, Stepping):
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
        self.stats = {"batches": 0, "largest_batch": 0, "generated_tokens": 0, "recomputed_prefixes": 0}
        self._wakeup = threading.Condition()
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
    def live_stats(self) -> dict[str, int | bool | str | None]:
        """The cumulative stats, the requests and control actions there are now, and what halts the engine."""
        with self._wakeup:
            now = {"running_requests": len(self.running), "waiting_requests": len(self.waiting)}
            halts = {"paused": self.paused, "held": self.held, "steps_left": self.steps_left}
            return {**self.stats, **now, "queued_controls": len(self.controls), **halts}

    @property
    def halted(self) -> bool:
        return self.paused or self.held is not None

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
                        self._wakeup.wait(timeout=0.5)
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
        self._settle_steps()
        if self._pause_settled:
            return self._settle_pause
        if self.controls and self._can_run(self.controls[0]):
            action = self.controls.popleft()
            return lambda: self._run_control(action)
        if any(seq.abort_message is not None for seq in self.running):
            return self._drop_aborted_running  # aborts take effect at once, paused or not
        if self.running and self._take_step():
            return self._step
        if self.waiting and self._take_step():
            self.batch_lora = self.waiting[0].lora_name
            self.running = [seq for seq in self.waiting if seq.lora_name == self.batch_lora][
                : self.max_running_requests
            ]
            taken = {id(seq) for seq in self.running}
            self.waiting = deque(seq for seq in self.waiting if id(seq) not in taken)
            self.needs_prefill = True
            self.stats["batches"] += 1
            self.stats["largest_batch"] = max(self.stats["largest_batch"], len(self.running))
            return self._step
        return None

    def _can_run(self, action: ControlAction) -> bool:
        if action.needs_idle and self.running and not self.halted:
            return False
        return action.waits_for is None or not any(map(action.waits_for, itertools.chain(self.waiting, self.running)))

    def _run_control(self, action: ControlAction) -> None:
        try:
            action.future.set_result(action.fn())
        except Exception as exc:  # reported to the caller (an HTTP 400), the engine goes on
            action.future.set_exception(exc)

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
            self.lockstep(Action.END_BATCH)
        for future in settled:
            future.set_result(len(retracted))

    def _step(self) -> None:
        self._drop_aborted_running()
        if not self.running:
            return
        try:
            self._advance_batch()
        except Exception as exc:  # the batch's requests fail with the reason; the engine goes on
            self._fail_batch(exc)

    def _advance_batch(self) -> None:
        batch = {"lora_name": self.batch_lora, "capture_routes": any(s.routes_start is not None for s in self.running)}
        if self.needs_prefill:
            prompts, keep = [s.prefill_ids for s in self.running], prefill_keep(self.running)
            self.stats["recomputed_prefixes"] += sum(1 for s in self.running if s.output_ids)
            for seq in self.running:
                seq.routes.clear()  # a (re)prefill reads every position again: its routes replace any kept
            logits = self.lockstep(Action.PREFILL, prompts=prompts, keep=keep, **batch)
            logits = take_input_logprobs(self.running, logits) if keep > 1 else logits
            self.needs_prefill = False
        else:
            logits = self.lockstep(Action.DECODE, tokens=[s.output_ids[-1] for s in self.running], **batch)
        if batch["capture_routes"]:
            record_routes(self.running, self.read_routes())
        logprobs = torch.log_softmax(logits, dim=-1)
        for seq, row, row_logprobs in zip(self.running, logits, logprobs):
            advance(seq, row, row_logprobs, self.stops)
        self.stats["generated_tokens"] += len(self.running)
        with self._wakeup:
            self._retire_finished()

    def _retire_finished(self) -> None:
        keep = [row for row, seq in enumerate(self.running) if seq.finish is None]
        for seq in self.running:
            if seq.finish is not None:
                self._finish(seq, seq.finish)
        if not keep:
            self.running = []
            self.lockstep(Action.END_BATCH)
        elif len(keep) < len(self.running):
            self.running = [self.running[row] for row in keep]
            self.lockstep(Action.KEEP_ROWS, rows=keep)

    def _fail_batch(self, exc: Exception) -> None:
        log.exception("a batch of %d requests failed; they finish as aborted, the engine goes on", len(self.running))
        text = str(exc).strip()
        reason = f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"[:500]
        with self._wakeup:
            for seq in self.running:
                if seq.finish is None:  # a request that finished before the failure keeps its own reason
                    seq.finish = FinishReason(type="abort", message=f"the engine failed this batch: {reason}")
                self._finish(seq, seq.finish)
            self.running = []
        self.lockstep(Action.END_BATCH)  # a failure here is the loop's own: it stops and says why

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        seq.finish = reason
        if not (reason.type == "stop" and isinstance(reason.matched, str)):
            seq.text = seq.finished_text(self.tokenizer)
        if not seq.future.done():
            seq.future.set_result(wire_result(seq, self.weight_version, self.tokenizer))

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
