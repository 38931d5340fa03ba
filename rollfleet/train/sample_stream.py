"""Where a GRPO step's samples come from when they are made ahead of the trainer (grpo.max_staleness
k >= 1) or filtered by dynamic sampling: prompt groups, each with its n samples and their rewards.

Ordering, stated once:
- The producer makes groups in chunks, one `fleet.generate` call each, inside `gate.generating()`.
  A weight push runs inside `gate.pushing()`: it waits for the chunk under way to end, and no chunk
  starts while a push waits or runs (requests wait during a push). So every sample of a chunk comes
  from the one version the fleet served when it started (the embedded engine, too, applies an update
  only between batches).
- A chunk starts only when `producer_room` allows it: no group it makes can be used later than step
  version + k. With k >= 1 a thread of its own runs the producer while the trainer trains; with k = 0
  (dynamic sampling) `take` runs it inline, once the trainer pushed the step's version.
- `take(step)` uses groups first in, first out. A group older than step - k is dropped and its prompt
  generated again (`stale_dropped`); with dynamic sampling a group whose rewards are all equal is
  dropped for good while the step's extra budget lasts, then kept (it carries no gradient).
- Every prompt is a position of the stream (rollfleet.train.prompt_cursor), consumed once when a step
  uses or drops it; positions queued but unused at a checkpoint are generated again after a resume.
- A producer failure (no engine left, a reward that raises) is raised by the next `take`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace

from rollfleet.agents.rollout import AgentRollout
from rollfleet.config import RunConfig
from rollfleet.data.prompts import PromptDataset, PromptItem
from rollfleet.fleet.fleet import Fleet
from rollfleet.fleet.sampling_seeds import derive_seed
from rollfleet.sample import Sample
from rollfleet.train.invariants import producer_room, sample_version
from rollfleet.train.prompt_cursor import PromptCursor

log = logging.getLogger("rollfleet.stream")


def prompt_seeds(run_seed: int | None, positions: Iterable[int]) -> list[int] | None:
    """The sampling seed of each prompt at these positions of the prompt stream (None: unseeded; run_seed
    is RunConfig.sampling_seed). A prompt's seed depends on its position only, so a group generated
    again, or by another engine, or after a resume, draws from the same seed."""
    return None if run_seed is None else [derive_seed(run_seed, p) for p in positions]


def generate_and_reward(
    fleet: Fleet,
    reward_fn: Callable,
    items: list[PromptItem],
    threads: int,
    timed: Callable = lambda _: nullcontext(),
    routed_experts: bool = False,
    agent: AgentRollout | None = None,
    seeds: list[int] | None = None,
) -> list[Sample]:
    """Samples with their rewards; rewards start as each prompt's samples arrive, while the rest still
    generate (`timed(phase)`: the generate and the reward phases, e.g. StepClock.phase; `routed_experts`:
    each sample carries its engine's expert choices, for routing replay; `seeds`: one per item,
    `prompt_seeds`). With `agent` the samples are its episodes (rollout.sampling.n per prompt),
    rewarded by their environment."""
    if agent is not None:
        with timed("generate"):  # the environment's steps (tools) included
            return agent.run(items, fleet.rollout.sampling.n, seeds=seeds)
    with ThreadPoolExecutor(threads) as pool:
        pending = {}

        def score(group: list[Sample]) -> None:
            for s in group:
                pending[s.prompt_index, s.sample_index] = pool.submit(reward_fn, s.text, items[s.prompt_index].answer)

        with timed("generate"):
            prompts = [item.prompt for item in items]
            samples = fleet.generate(prompts, on_group=score, routed_experts=routed_experts, seeds=seeds)
        with timed("reward"):  # only what generation did not already hide
            for sample in samples:
                sample.reward = pending[sample.prompt_index, sample.sample_index].result()
    return samples


class GenerationGate:
    """Generate calls (any number at once) against weight pushes (one, alone): a push waits for the
    calls under way to end, and no call starts while a push waits or runs."""

    def __init__(self):
        self._cond = threading.Condition()
        self._calls = 0
        self._pushes = 0  # waiting or running
        self._held_calls = 0  # generate calls waiting for a push to end

    @property
    def state(self) -> dict[str, int]:
        """Generate calls under way and held, pushes waiting or running (for logs and tests)."""
        with self._cond:
            return {"calls": self._calls, "held_calls": self._held_calls, "pushes": self._pushes}

    @contextmanager
    def generating(self):
        with self._cond:
            self._held_calls += 1
            self._cond.wait_for(lambda: not self._pushes)
            self._held_calls -= 1
            self._calls += 1
        try:
            yield
        finally:
            with self._cond:
                self._calls -= 1
                self._cond.notify_all()

    @contextmanager
    def pushing(self):
        """Yields the seconds the push waited for generation to stop."""
        began = time.perf_counter()
        with self._cond:
            self._pushes += 1
            self._cond.wait_for(lambda: not self._calls)
        try:
            yield time.perf_counter() - began
        finally:
            with self._cond:
                self._pushes -= 1
                self._cond.notify_all()


@dataclass
class Group:
    """One prompt's n samples, with rewards; `position` is the prompt's place in the stream."""

    position: int
    item: PromptItem
    samples: list[Sample]

    @property
    def version(self) -> int:
        """The oldest weight version among its tokens."""
        return min(sample_version(s) for s in self.samples)

    @property
    def informative(self) -> bool:
        """Whether its rewards differ (a group of equal rewards has advantage 0: no gradient)."""
        return len({s.reward for s in self.samples}) > 1


@dataclass
class StepSamples:
    """What `take` gave one step, and how it went."""

    groups: list[Group] = field(default_factory=list)
    wait_seconds: float = 0.0  # the trainer waited this long for them
    busy_seconds: float = 0.0  # the producer generated this long since the last take
    stale_dropped: int = 0  # groups older than step - k, generated again
    dropped_positions: list[int] = field(default_factory=list)  # dynamic sampling: equal rewards, dropped
    kept_uninformative: int = 0  # equal rewards kept once the extra budget was spent
    queued: int = 0  # groups made or being made for later steps, when the step took its own

    @property
    def items(self) -> list[PromptItem]:
        return [g.item for g in self.groups]

    @property
    def samples(self) -> list[Sample]:
        """The groups' samples numbered by group (prompt_index = the group's place in this step)."""
        return [replace(s, prompt_index=i) for i, g in enumerate(self.groups) for s in g.samples]

    def figures(self, ages: list[int]) -> dict:
        """The step's metrics: staleness (step - oldest version, per sample), the trainer's wait, the
        share of the producer's generating time hidden behind training (overlap), what was dropped."""
        busy = self.busy_seconds
        return {
            "staleness_max": max(ages),
            "staleness_mean": sum(ages) / len(ages),
            "sample_wait_seconds": self.wait_seconds,
            "generate_busy_seconds": busy,
            "overlap": max(0.0, 1.0 - self.wait_seconds / busy) if busy else 0.0,
            "stale_dropped": self.stale_dropped,
            "dynamic_dropped": len(self.dropped_positions),
            "dynamic_kept_uninformative": self.kept_uninformative,
            "queued_groups": self.queued,
            "prompt_positions": [g.position for g in self.groups],
            "dropped_positions": list(self.dropped_positions),
        }


class SampleStream:
    def __init__(
        self,
        cfg: RunConfig,
        fleet: Fleet,
        dataset: PromptDataset,
        reward_fn: Callable,
        cursor: PromptCursor,
        step: int,
        agent: AgentRollout | None = None,
    ):
        """`step`: the first step to take samples, whose version the fleet serves now; `agent`: the
        samples are its episodes."""
        grpo = cfg.grpo
        self.fleet, self.dataset, self.reward_fn, self.cursor, self.agent = fleet, dataset, reward_fn, cursor, agent
        self.routed_experts = cfg.train.routing_replay
        self.k, self.per_step, self.seed, self.threads = (
            grpo.max_staleness,
            grpo.prompts_per_step,
            grpo.seed,
            grpo.reward_threads,
        )
        self.n = cfg.rollout.sampling.n
        self.sampling_seed = cfg.sampling_seed
        self.extra_budget = grpo.dynamic_sampling_max_extra if grpo.dynamic_sampling else 0
        self.dynamic = grpo.dynamic_sampling
        self.gate = GenerationGate()
        self.version = self.next_step = step  # the fleet's version; the first step that has not taken its groups
        self.failure: BaseException | None = None
        self._cond = threading.Condition()
        self._ready: deque[Group] = deque()
        self._in_flight = 0  # groups handed out to a chunk under way
        self._busy, self._busy_since = 0.0, None
        self._closing = False
        self._thread = None
        if self.k:
            self._thread = threading.Thread(target=self._produce, name="rollfleet-producer", daemon=True)
            self._thread.start()

    # ---- the trainer's side -------------------------------------------------------------------
    def take(self, step: int) -> StepSamples:
        """prompts_per_step groups for `step`, waiting for the producer (or, k = 0, generating now)."""
        began, out, budget = time.perf_counter(), StepSamples(), self.extra_budget
        while len(out.groups) < self.per_step:
            group = self._next_group(self.per_step - len(out.groups))
            if step - group.version > self.k:  # made before a push it should have waited for: again
                self.cursor.give_back(group.position)
                out.stale_dropped += 1
            elif self.dynamic and not group.informative and budget:
                budget -= 1
                self.cursor.consume(group.position)
                out.dropped_positions.append(group.position)
            else:
                out.kept_uninformative += self.dynamic and not group.informative
                out.groups.append(group)
        for group in out.groups:
            self.cursor.consume(group.position)
        with self._cond:
            self.next_step = step + 1
            out.queued = len(self._ready) + self._in_flight
            out.busy_seconds = self._take_busy()
            self._cond.notify_all()
        out.wait_seconds = time.perf_counter() - began
        return out

    def pushed(self, version: int) -> None:
        """The trainer's push of `version` is verified: groups may now be made for later steps."""
        with self._cond:
            self.version = version
            self._cond.notify_all()

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop making groups; a chunk under way ends with its generate call (bounded by the fleet's
        request timeout), and is waited for up to `timeout_s`."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _next_group(self, needed: int) -> Group:
        if self._thread is None:
            if not self._ready:
                self._make(self._reserve(needed))
            return self._ready.popleft()
        with self._cond:
            self._cond.wait_for(lambda: self._ready or self.failure is not None)
            if self._ready:  # groups made before a failure are still good
                return self._ready.popleft()
            raise RuntimeError(f"the sample producer failed: {self.failure!r}") from self.failure

    def _take_busy(self) -> float:
        """The producer's generating seconds since the last call, the chunk under way included."""
        now = time.perf_counter()
        busy = self._busy + (now - self._busy_since if self._busy_since is not None else 0.0)
        self._busy, self._busy_since = 0.0, (now if self._busy_since is not None else None)
        return busy

    # ---- the producer's side ------------------------------------------------------------------
    def _produce(self) -> None:
        try:
            while (positions := self._reserve(self.per_step)) is not None:
                self._make(positions)
        except BaseException as exc:  # noqa: BLE001 - handed to the trainer's next take
            log.exception("the sample producer stopped")
            with self._cond:
                self.failure = exc
                self._cond.notify_all()

    def _reserve(self, most: int) -> list[int] | None:
        """Up to `most` positions, once `producer_room` allows any (None: closing)."""
        with self._cond:
            while not (room := producer_room(self.version, self.next_step, self.k, self.per_step, self._queued)):
                if self._closing:
                    return None
                assert self._thread is not None, "k = 0: take runs once the step's version is pushed"
                self._cond.wait()
            if self._closing:
                return None
            count = min(room, most)
            self._in_flight += count
        return self.cursor.hand_out(count)

    @property
    def _queued(self) -> int:
        return len(self._ready) + self._in_flight

    def _make(self, positions: list[int]) -> None:
        items = [self.dataset.batch(p, 1, seed=self.seed)[0] for p in positions]
        with self.gate.generating():
            with self._cond:
                self._busy_since = time.perf_counter()
            try:
                samples = generate_and_reward(
                    self.fleet,
                    self.reward_fn,
                    items,
                    self.threads,
                    routed_experts=self.routed_experts,
                    agent=self.agent,
                    seeds=prompt_seeds(self.sampling_seed, positions),
                )
            finally:
                with self._cond:
                    self._busy += time.perf_counter() - self._busy_since
                    self._busy_since = None
        by_prompt: list[list[Sample]] = [[] for _ in items]
        for sample in samples:
            by_prompt[sample.prompt_index].append(sample)
        with self._cond:
            self._ready.extend(Group(p, item, group) for p, item, group in zip(positions, items, by_prompt))
            self._in_flight -= len(positions)
            self._cond.notify_all()
