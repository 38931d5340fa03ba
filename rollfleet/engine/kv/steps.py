"""Continuous batching over the paged KV pool, on tp rank 0: which tokens each step feeds, which
pages they go to, and which sequences sample after it. The scheduler (scheduler.py) owns the queues
and calls this for every step of its running set; `DenseBatches` (batch_step.py) is the same
interface over today's left-padded cache, for models the paged path does not serve.

A sequence's KV holds its first `kv_len` tokens of prompt + output. Each step is either
- a prefill step: sequences with more than one token to feed (new ones, chunks of long prompts,
  recomputes after a weight update or a preemption), at most `chunk_tokens` tokens in all; a
  sequence whose prompt is fully in samples its first token, the others go on next step; or
- a decode step: every other running sequence feeds its last token and samples the next one
  (with --enable-mixed-chunk the decode rows with room ride along a prefill step instead of waiting).
Requests join the running set at any step (which ones fit the pool: kv/admission.py); nobody's KV is
recomputed for it. A steady decode step may stay in flight past its step (kv/overlap.py).

The n samples of a prompt prefill it once: the first is fed, the others wait, then share its full
pages and get a copy of its last partial one (`fork`), and all sample from the same logits. A new
sequence starts from the longest run of cached full pages its tokens begin with (kv/blocks.py;
`cached_tokens` in meta_info) under its root: the generation of the base weights and the adapter's
identity (name and load) when its prefill starts, which its pages are recorded under too. A running
sequence whose root is no longer the current one (the weights changed under a paused batch, by any
route) recomputes its KV before its next token. When a decode step finds no free page, the
sequences admitted last give theirs back and wait again at the head of the queue (preemption by
recompute: nothing lost, nothing doubled). A steady decode step skips the prefill's bookkeeping.

One job: PagedBatches, one step of the running set over the pool. Its feeds, page growth, preemption,
forks and sampling all change the same state (each sequence's pages and `kv_len`, the pool's free
pages) within one step, in an order the step alone keeps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from rollfleet.engine.kv.admission import PagedAdmission
from rollfleet.engine.kv.blocks import BlockPool, OutOfPages
from rollfleet.engine.kv.overlap import Overlap
from rollfleet.engine.sequences.logprobs import fill_input, input_positions
from rollfleet.engine.sequences.next_token import StopRules
from rollfleet.engine.sequences.sampling import Sampler
from rollfleet.engine.sequences.sequence import Sequence
from rollfleet.engine.tp.lockstep import Action
from rollfleet.wire.protocol import FinishReason


@dataclass
class StepOutcome:
    host_bytes: int = 0
    sampled: int = 0
    recomputed: int = 0  # sequences whose output so far is fed again (after a retract, preemption, update)
    prefill_tokens: int = 0  # tokens fed by prefill steps (a prompt's n samples feed it once)
    prefill: bool = False  # a prefill step (eager), not a decode step (a CUDA graph where captured)
    launched: bool = True  # a step ran on the device (not so when only the step in flight was recorded)
    device_wait: float = 0.0  # seconds the host blocked for the recorded step's draws (draws.py)
    preempted: list[Sequence] = field(default_factory=list)  # back to the head of the queue, in order

    def add_to(self, stats: dict) -> None:
        """Its figures into the scheduler's cumulative stats (scheduler.py's STATS)."""
        stats["host_bytes"] += self.host_bytes
        stats["generated_tokens"] += self.sampled
        stats["recomputed_prefixes"] += self.recomputed
        stats["prefill_tokens"] += self.prefill_tokens
        stats["device_wait_seconds"] += self.device_wait  # with the overlapped step, the device ran the next
        stats["device_waits"] += self.device_wait > 0


@dataclass
class _Feed:
    seq: Sequence
    count: int  # tokens fed this step
    logits_from: int = 0  # packed index of the first logits row this feed returns
    rides: bool = False  # a decode row riding along a prefill step (--enable-mixed-chunk)


class PagedBatches(PagedAdmission, Overlap):
    joins_recompute = False

    def __init__(
        self,
        blocks: BlockPool,
        *,
        lockstep: Callable[..., Any],
        sampler: Sampler,
        stops: StopRules,
        read_routes: Callable[[], torch.Tensor | None],
        kv_epoch: Callable[[], int],
        weights_generation: Callable[[], int],
        adapter_identity: Callable[[str | None], str],
        chunk_tokens: int | None,
        overlap: bool = False,
        mixed: bool = False,
    ):
        """`weights_generation()`: a number every change of the base weights bumps;
        `adapter_identity(lora_name)`: the adapter's name and load (weight_update.py, lora_merge.py);
        `overlap`: decode steps may overlap the host's work (kv/overlap.py); `mixed`: decode rows ride
        along prefill steps (SGLang's --enable-mixed-chunk) instead of waiting for them."""
        self.blocks, self.lockstep, self.sampler, self.stops = blocks, lockstep, sampler, stops
        self.read_routes, self.kv_epoch, self.chunk_tokens = read_routes, kv_epoch, chunk_tokens
        self.weights_generation, self.adapter_identity = weights_generation, adapter_identity
        self.overlap, self.mixed = overlap, mixed
        self.epoch = None  # the pool's epoch the pages were handed out in
        self.generation = None  # the weights' generation the cache's records were made in
        self.copies: list[tuple[int, int]] = []  # forks' partial pages, copied before the next step

    # ---- one step ---------------------------------------------------------------------------
    def advance(self, running: list[Sequence], recompute: bool, lora_name: str | None, overlap=False) -> StepOutcome:
        """One step of `running`; `overlap`: its draws may stay in flight past it (kv/overlap.py)."""
        outcome = StepOutcome()
        if self.inflight is not None:
            self._keep_flying(running, overlap and not recompute, lora_name, outcome)
            return outcome
        if self.epoch != self.kv_epoch():  # the pool was released or resumed: no page holds KV
            self.blocks.reset()
            for seq in running:
                _forget_kv(seq)
            self.epoch, self.copies = self.kv_epoch(), []
        if self.generation != self.weights_generation():  # no record can match again: their pages go back now
            self.flush()
            self.generation = self.weights_generation()
        # the weights changed under the running set (the scheduler says so after an update; the
        # roots show any change): its KV is the old weights'. One adapter runs at a time.
        root = self._root(lora_name)
        stale = running if recompute else [s for s in running if s.kv_root is not None and s.kv_root != root]
        if stale:
            self.drop(stale)
            self.copies = []  # the forks of the last step: their pages were made with the old weights too
        if all(map(_decodable, running)):  # the steady state: no prefill, no sample waits on one
            self._siblings, feeds = {}, self._decode_feeds(running, outcome, every_row=True)
        else:
            self._siblings = self._pair_siblings(running)
            feeds = self._prefill_feeds(running, outcome)
            outcome.prefill = bool(feeds)
            if not feeds:
                feeds = self._decode_feeds(running, outcome)
            elif self.mixed:
                feeds += self._riders(running)
        if feeds:
            self._run(feeds, lora_name, outcome, fly=overlap and self.overlap and not outcome.preempted)
        return outcome

    def _pair_siblings(self, running: list[Sequence]) -> dict[int, list[Sequence]]:
        """New samples of one prompt wait for the first one's prefill (`fork_of`); by leader."""
        leaders: dict[int, Sequence] = {}
        waiting_on: dict[int, list[Sequence]] = {}
        present = {id(seq) for seq in running}
        for seq in running:
            if seq.fork_of is not None and (id(seq.fork_of) not in present or seq.fork_of.finish is not None):
                seq.fork_of = None  # its leader left (aborted alone, or finished): it prefills itself
            if seq.fork_of is None and not (seq.kv_len or seq.pages or seq.output_ids):
                leader = leaders.setdefault(id(seq.prompt_ids), seq)
                same_asks = leader.ask == seq.ask and leader.routes_start == seq.routes_start
                if leader is not seq and same_asks and leader.lora_name == seq.lora_name:
                    seq.fork_of = leader
            if seq.fork_of is not None:
                waiting_on.setdefault(id(seq.fork_of), []).append(seq)
        return waiting_on

    def _prefill_feeds(self, running: list[Sequence], outcome: StepOutcome) -> list[_Feed]:
        budget = self.chunk_tokens
        feeds: list[_Feed] = []
        for seq in running:
            left = _total(seq) - seq.kv_len
            if seq.fork_of is not None or (left <= 1 and seq.output_ids):
                continue
            if self._pages_wanted(seq) > self.blocks.usable:
                self._too_long(seq)
                continue
            if not seq.pages and not seq.kv_len:  # a (re)prefill starts
                outcome.recomputed += bool(seq.output_ids)
                seq.kv_root = self._root(seq.lora_name)
                if _may_share(seq):
                    seq.pages = self.blocks.match(seq.prefill_ids, seq.kv_root)
                    seq.kv_len = seq.cached_tokens = len(seq.pages) * self.blocks.page_size
                    left = _total(seq) - seq.kv_len
            count = left if budget is None or not _may_share(seq) else min(left, budget)
            if feeds and budget is not None and count > budget:
                break
            if not self._grow(seq, seq.kv_len + count):
                # nobody decodes to free pages: the sequences admitted last give theirs back
                stuck = not feeds and not any(map(_decodable, running))
                if stuck and self._make_room(seq, seq.kv_len + count, running, outcome):
                    feeds.append(_Feed(seq, count))
                break
            feeds.append(_Feed(seq, count))
            if budget is not None:
                budget -= count
                if budget <= 0:
                    break
        return feeds

    def _decode_feeds(self, running: list[Sequence], outcome: StepOutcome, every_row: bool = False) -> list[_Feed]:
        """One token for every decodable row (`every_row`: each of `running` is)."""
        feeds, page = [], self.blocks.page_size
        for seq in running if every_row else [s for s in running if _decodable(s)]:
            if seq.kv_len < len(seq.pages) * page:  # the common case: room in its last page
                feeds.append(_Feed(seq, 1))
            elif seq.pages and self._make_room(seq, seq.kv_len + 1, running, outcome):  # no pages: preempted
                feeds.append(_Feed(seq, 1))
        gone = {id(s) for s in outcome.preempted}
        return [feed for feed in feeds if id(feed.seq) not in gone]

    def _riders(self, running: list[Sequence]) -> list[_Feed]:
        """The decode rows that ride along this prefill step: those with room for their token (none is
        preempted for it: a prefill fed this step may hold the pages it would take)."""
        page = self.blocks.page_size
        room = [s for s in running if _decodable(s) and (s.kv_len < len(s.pages) * page or self._grow(s, s.kv_len + 1))]
        return [_Feed(seq, 1, rides=True) for seq in room]

    def _make_room(self, seq: Sequence, tokens: int, running: list[Sequence], outcome: StepOutcome) -> bool:
        """Pages for `tokens` of `seq`'s KV, preempting the sequences admitted last while the pool is
        short; False when nobody else holds any (`seq` alone is too long for the pool: it ends)."""
        while not self._grow(seq, tokens):
            victim = next((s for s in reversed(running) if s.pages and s is not seq), None)
            if victim is None:
                self._too_long(seq)
                return False
            self._preempt(victim, running, outcome)
        return True

    def _grow(self, seq: Sequence, tokens: int) -> bool:
        """Pages for `tokens` of `seq`'s KV; False (nothing taken) when the pool has too few."""
        more = self.blocks.pages_for(tokens) - len(seq.pages)
        if more <= 0:
            return True
        try:
            seq.pages += self.blocks.allocate(more)
        except OutOfPages:
            return False
        return True

    def _preempt(self, victim: Sequence, running: list[Sequence], outcome: StepOutcome) -> None:
        for seq in [victim, *(s for s in running if s.fork_of is victim)]:
            self._release(seq)
            seq.fork_of = None
            outcome.preempted.append(seq)

    def _too_long(self, seq: Sequence) -> None:
        tokens = self.blocks.usable * self.blocks.page_size
        seq.finish = FinishReason(
            type="abort",
            message=f"the request needs {_total(seq) + 1} tokens of KV cache, the whole pool holds "
            f"{tokens}: raise --mem-fraction-static or --max-total-tokens, or send a shorter prompt",
        )

    def _run(self, feeds: list[_Feed], lora_name: str | None, outcome: StepOutcome, fly: bool) -> None:
        if outcome.prefill:
            rows, logits_at = self._prefill_rows(feeds, outcome)
        else:  # decode: each row feeds its newest token and wants the logits after it
            rows = [(f.seq.kv_len, [f.seq.output_ids[-1]], f.seq.pages) for f in feeds]
            logits_at = list(range(len(feeds)))  # in feed order (_sample reads them so)
        capture = any(f.seq.routes_start is not None for f in feeds)
        copies, self.copies = self.copies, []
        riders = sum(feed.rides for feed in feeds)  # last in `feeds` (advance)
        logits = self.lockstep(
            Action.STEP, rows=rows, logits_at=logits_at, copies=copies, lora_name=lora_name, capture_routes=capture,
            riders=riders,
        )  # fmt: skip
        if capture:
            self._record_routes(feeds, self.read_routes())
        self._sample(feeds, logits, outcome, fly and not capture)

    def _prefill_rows(self, feeds: list[_Feed], outcome: StepOutcome) -> tuple[list, list[int]]:
        """A prefill step's rows and the packed positions whose logits it wants."""
        rows, logits_at, packed = [], [], 0
        for feed in feeds:
            seq = feed.seq
            if seq.kv_len == 0:
                seq.routes.clear()  # a (re)prefill reads every position again: its routes replace any kept
            at_end = seq.output_ids and seq.kv_len + feed.count == _total(seq)
            fed = seq.prefill_ids[seq.kv_len : seq.kv_len + feed.count]
            fed = [seq.output_ids[-1]] if at_end and feed.count == 1 else fed
            rows.append((seq.kv_len, fed, seq.pages))
            last = packed + feed.count - 1
            if seq.kv_len + feed.count == _total(seq):
                first = last - _input_count(seq)
                feed.logits_from = len(logits_at)
                logits_at += range(first, last + 1)
            packed += feed.count
        if any(feed.count > 1 or not feed.seq.output_ids for feed in feeds):
            outcome.prefill_tokens += packed - sum(feed.rides for feed in feeds)
        return rows, logits_at

    def _sample(self, feeds: list[_Feed], logits: torch.Tensor, outcome: StepOutcome, fly: bool) -> None:
        if not outcome.prefill:  # decode: every row samples, from its own row of logits (or leaves them in flight)
            for feed in feeds:
                feed.seq.kv_len += 1
            return self._draw([feed.seq for feed in feeds], logits, outcome, fly)
        samplers, index = [], []
        for feed in feeds:
            seq = feed.seq
            seq.kv_len += feed.count
            if seq.kv_len < _total(seq):
                continue  # a chunk: the prompt goes on next step
            count = _input_count(seq)
            if count:
                lp = torch.log_softmax(logits[feed.logits_from : feed.logits_from + count].float(), dim=-1)
                outcome.host_bytes += fill_input(seq.record, lp, seq.prompt_ids, seq.ask)
            forks = self._fork(seq) if id(seq) in self._siblings else ()
            for member in (seq, *forks):
                samplers.append(member)
                index.append(feed.logits_from + count)
            if not seq.output_ids:
                self.blocks.register(seq.prefill_ids, seq.pages, seq.kv_root)
        if samplers:
            rows = logits[torch.tensor(index, device=logits.device)] if len(index) != logits.shape[0] else logits
            self._draw(samplers, rows, outcome)

    def _fork(self, leader: Sequence) -> list[Sequence]:
        """The samples waiting on `leader`'s prefill share its full pages and get a copy of its last
        partial one (copied before the next step writes anything); one the pool has no page for
        stays a new sequence (it prefills later, from the cached full pages)."""
        forked = []
        full, partial = divmod(leader.kv_len, self.blocks.page_size)
        for seq in self._siblings.get(id(leader), []):
            seq.fork_of = None
            if partial and self.blocks.available == 0:
                continue
            seq.pages = list(leader.pages[:full])
            self.blocks.hold(seq.pages)
            if partial:
                seq.pages += self.blocks.allocate(1)
                self.copies.append((leader.pages[full], seq.pages[-1]))
            seq.kv_len = seq.cached_tokens = leader.kv_len
            seq.kv_root = leader.kv_root
            seq.record = leader.record.fork()
            seq.routes = list(leader.routes)
            forked.append(seq)
        return forked

    def _record_routes(self, feeds: list[_Feed], routes: torch.Tensor) -> None:
        packed = 0
        for feed in feeds:
            if feed.seq.routes_start is not None:
                feed.seq.routes.append(routes[packed : packed + feed.count])
            packed += feed.count

    # ---- the running set changes --------------------------------------------------------
    def retire(self, running: list[Sequence], keep: list[int]) -> None:
        """The sequences of `running` not in `keep` are done: their full pages stay cached."""
        kept = set(keep)
        for row, seq in enumerate(running):
            if row not in kept:
                if seq.pages and seq.kv_len and seq.finish is not None and seq.finish.type != "abort":
                    self.blocks.register(seq.prefill_ids[: seq.kv_len], seq.pages, seq.kv_root)
                self._release(seq)

    def drop(self, seqs: list[Sequence]) -> None:
        """These sequences' KV goes (a retract, a failed step, a weight change): recomputed when they run.
        The other tp ranks are told the batch ended: a follower whose part of a failed step failed
        waits for exactly that before it follows the next step (lockstep.follow)."""
        self._discard()
        for seq in seqs:
            self._release(seq)
        self.lockstep(Action.END_BATCH)

    def flush(self) -> None:
        """Forget every cached prefix (frees their pages; the roots keep stale ones from matching anyway)."""
        self.blocks.flush()

    def _root(self, lora_name: str | None) -> str:
        """What a page's KV depends on besides its tokens: the base weights and the adapter."""
        return f"weights {self.weights_generation()}, adapter {self.adapter_identity(lora_name)}"

    def _release(self, seq: Sequence) -> None:
        if seq.pages:
            self.blocks.release(seq.pages)
        _forget_kv(seq)


def _decodable(seq: Sequence) -> bool:
    """Fed up to its last token: the next step decodes it."""
    return seq.fork_of is None and bool(seq.output_ids) and seq.kv_len == _total(seq) - 1


def _total(seq: Sequence) -> int:
    """Tokens of prompt + output (without building the list: the hot path asks this of every row)."""
    return len(seq.prompt_ids) + len(seq.output_ids)


def _forget_kv(seq: Sequence) -> None:
    seq.pages, seq.kv_len, seq.kv_root = [], 0, None


def _may_share(seq: Sequence) -> bool:
    """Whether a sequence may start from cached pages and be fed in chunks: not when it wants the
    logprobs or the routes of every prompt position (they come from one full prefill)."""
    return seq.routes_start is None and not (seq.ask.wants_input and not seq.output_ids)


def _input_count(seq: Sequence) -> int:
    return 0 if seq.output_ids else input_positions(len(seq.prompt_ids), seq.ask)
