"""Many episodes in flight over the fleet: each turn one generate call, each episode one Sample.

Ordering, stated once:
- An episode's token list only grows: the prompt's ids, then each turn's output ids exactly as the
  engine returned them, then the observation's ids (rollfleet.agents.markup, rendered once). The next
  turn's request is that whole list (`input_ids`): nothing is decoded and encoded again.
- Each turn is a `Router.generate` at the weight version the rollout started with, sent to the engine
  that served the episode's previous turn while it serves (its prefix is warm), else to any serving
  engine. A turn whose engine dies under it is sent again, from the same ids, to another engine, and
  only the answer that completed is kept: no turn is lost or doubled, and every token's version is
  the one its engine reported.
- With seeds (one per record: rollfleet.fleet.sampling_seeds) each turn carries `sampling_seed` =
  derive_seed(record's seed, episode, turn), built once per turn: a turn sent again carries it too,
  so a seeded episode draws the same tokens whichever engine serves its turns.
- An environment step (a tool call) slower than `tool_timeout_s`, or one that raises, ends only its
  episode (finish reason `tool_timeout` / `tool_error`, reward `failed_reward`); so do the limits on
  turns (`max_turns`) and tokens (`max_total_tokens`: a turn asks for at most what is left, and an
  observation that would pass it is not appended), and an engine's 4xx answer to a turn (the request
  is wrong for the engine: past its context length, a token id outside the vocabulary; finish reason
  `engine_rejected` with the engine's status and message; the router sends a 4xx to no other engine).
  A dead engine or a lost connection is not the episode's fault: the router sends the turn elsewhere.
  When every episode of a call ends `engine_rejected` the call raises with the first engine message:
  that is the run's configuration, not an episode (it must not train on failed rewards in silence).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Callable
from typing import Any

from rollfleet.agents.markup import TurnMarkup
from rollfleet.config.agent import AgentConfig
from rollfleet.envs.base import Done, Observation, Turn
from rollfleet.fleet.sampling_seeds import derive_seed
from rollfleet.sample import Sample, output_logprobs
from rollfleet.wire.errors import EngineError

log = logging.getLogger("rollfleet.agents")


class Episode:
    """One trajectory as it grows: one token list with its mask, logprobs and version spans."""

    def __init__(self, prompt_index: int, sample_index: int, prompt_ids: list[int]):
        self.sample = Sample(prompt_index, sample_index, prompt_ids, loss_mask=[], turns=0)
        now = time.perf_counter()
        self.sample.episode = {
            "engine_ids": [],
            "segments": [],
            # perf_counter seconds [start, end]: the episode, each generate call, each environment step
            "lifetime": [now, now],
            "generate_spans": [],
            "tool_spans": [],
        }

    @property
    def length(self) -> int:
        return len(self.sample.prompt_ids) + len(self.sample.output_ids)

    def add_turn(self, out: dict, engine_id: int) -> list[int]:
        s, meta, ids = self.sample, out["meta_info"], list(out["output_ids"])
        start = len(s.output_ids)
        s.output_ids += ids
        s.loss_mask += [1] * len(ids)
        s.logprobs += output_logprobs(meta)[: len(ids)]
        version = str(meta.get("weight_version", ""))
        spans = meta.get("weight_versions") or [{"version": version, "start": 0, "end": len(ids)}]
        s.weight_versions += [{**sp, "start": sp["start"] + start, "end": sp["end"] + start} for sp in spans if ids]
        s.weight_version, s.engine_id, s.turns = version, engine_id, s.turns + 1
        s.episode["engine_ids"].append(engine_id)
        s.episode["segments"].append(["model", start, len(s.output_ids)])
        return ids

    def add_observation(self, ids: list[int]) -> None:
        s = self.sample
        s.episode["segments"].append(["env", len(s.output_ids), len(s.output_ids) + len(ids)])
        s.output_ids += ids
        s.loss_mask += [0] * len(ids)
        s.logprobs += [0.0] * len(ids)

    def timed(self, kind: str, began: float) -> None:
        """Record a generate call or an environment step that began at `began` and ends now."""
        self.sample.episode[f"{kind}_spans"].append([began, time.perf_counter()])

    def finish(self, reason: str, reward: float, tokenizer, **detail) -> Sample:
        self.sample.episode["lifetime"][1] = time.perf_counter()
        self.sample.finish_reason = {"type": reason, **detail}
        self.sample.reward = float(reward)
        self.sample.text = tokenizer.decode(self.sample.output_ids)
        return self.sample


class AgentRollout:
    """`run(items, n)`: n episodes per dataset record, up to `max_in_flight` at once, as Samples in
    input order (record 0's episodes, then record 1's, ...), each with its reward."""

    def __init__(self, fleet, environment: type, environment_args: dict | None = None, limits=None):
        self.fleet, self.environment, self.environment_args = fleet, environment, dict(environment_args or {})
        self.limits: AgentConfig = limits or AgentConfig()
        self.markup = TurnMarkup(fleet.tokenizer)

    def run(
        self,
        items: list,
        n: int,
        on_episode: Callable[[Sample], None] | None = None,
        seeds: list[int] | None = None,
    ) -> list[Sample]:
        """`on_episode(sample)` runs on the engine pool's thread as each episode ends (must not block);
        `seeds` (one per record): every turn's sampling is seeded from its record's."""
        if seeds is not None and len(seeds) != len(items):
            raise ValueError(f"{len(seeds)} seeds for {len(items)} records: give one seed per record, or None")
        return self.fleet.pool.run(self._run(items, n, self.fleet.version, on_episode, seeds))

    async def _run(self, items, n, version, on_episode, seeds) -> list[Sample]:
        room = asyncio.Semaphore(self.limits.max_in_flight)

        async def one(prompt_index: int, sample_index: int) -> Sample:
            seed = None if seeds is None else seeds[prompt_index]
            async with room:
                sample = await self._episode(prompt_index, sample_index, items[prompt_index], version, seed)
            if on_episode is not None:
                on_episode(sample)
            return sample

        samples = list(await asyncio.gather(*(one(p, k) for p in range(len(items)) for k in range(n))))
        if samples and all(s.finish_reason["type"] == "engine_rejected" for s in samples):
            first = samples[0].finish_reason
            raise EngineRejectedAll(
                f"the engines refused a turn of every one of the call's {len(samples)} episodes; the first: "
                f"HTTP {first['status']}: {first['message']} (fix: keep grpo.agent.max_total_tokens within the "
                "engines' context length and the observations' token ids within the vocabulary)"
            )
        return samples

    def _request(self, env, ids: list[int], room: int, seed: int | None) -> dict[str, Any]:
        params = {**self.fleet.rollout.sampling.model_dump(), **getattr(env, "sampling", {}), "n": 1}
        params["max_new_tokens"] = min(params["max_new_tokens"], room)
        if seed is not None:
            params["sampling_seed"] = seed
        request = {"input_ids": ids, "sampling_params": params, "return_logprob": True}
        if self.fleet.rollout.backend == "embedded":  # the logprobs as one list (rollfleet.wire.protocol)
            request["return_logprob_values"] = True
        if self.fleet.lora_name is not None:  # a LoRA run: the adapter the last verified sync loaded
            request["lora_path"] = self.fleet.lora_name
        return request

    async def _episode(self, prompt_index: int, sample_index: int, item, version: str, seed: int | None) -> Sample:
        limits, tokenizer = self.limits, self.fleet.tokenizer
        env = self.environment(**self.environment_args)
        episode = Episode(prompt_index, sample_index, self.markup.prompt(env.start(item)))
        engine_id = None
        try:
            for index in range(limits.max_turns):
                room = limits.max_total_tokens - episode.length
                if room < 1:
                    raise _Ends("max_tokens")
                turn_seed = None if seed is None else derive_seed(seed, sample_index, index)
                out, engine_id = await self._generate(episode, env, room, version, engine_id, turn_seed)
                turn_ids = episode.add_turn(out, engine_id)
                turn = Turn(index, tokenizer.decode(turn_ids), turn_ids, out["meta_info"]["finish_reason"], engine_id)
                answer = await self._answer(episode, env, turn)
                if isinstance(answer, Done):
                    return episode.finish(answer.reason, answer.reward, tokenizer, **answer.info)
                observed = self.markup.observation(answer, turn_ids)
                if episode.length + len(observed) > limits.max_total_tokens:
                    raise _Ends("max_tokens")
                if index + 1 < limits.max_turns:
                    episode.add_observation(observed)
        except _Ends as end:
            return episode.finish(end.reason, limits.failed_reward, tokenizer, **end.detail)
        return episode.finish("max_turns", limits.failed_reward, tokenizer)

    async def _generate(self, episode: Episode, env, room: int, version: str, prefer: int | None, seed: int | None):
        """One turn's answer and its engine; an engine's 4xx ends the episode (`engine_rejected`)."""
        ids = episode.sample.prompt_ids + episode.sample.output_ids
        request = self._request(env, ids, room, seed)  # once: a retry sends this very request again
        began = time.perf_counter()
        try:
            outs, engine_id = await self.fleet.router.generate(request, version, prefer)
        except EngineError as exc:
            if not 400 <= exc.status_code < 500:
                raise  # an engine that failed while alive, on every live engine: the router's call
            s = episode.sample
            log.warning(
                "episode (%d, %d): the engine refused turn %d (%d tokens): HTTP %d: %s",
                *(s.prompt_index, s.sample_index, s.turns, len(ids), exc.status_code, exc.message),
            )
            raise _Ends("engine_rejected", status=exc.status_code, message=exc.message) from exc
        finally:
            episode.timed("generate", began)
        return outs[0], engine_id

    async def _answer(self, episode: Episode, env, turn: Turn) -> Observation | Done:
        """The environment's answer to a turn; a step past `tool_timeout_s` or one that raises ends the episode."""
        where = f"episode ({episode.sample.prompt_index}, {episode.sample.sample_index}): step {turn.index}"
        began = time.perf_counter()
        try:
            answer = await asyncio.wait_for(_step(env, turn), self.limits.tool_timeout_s)
        except TimeoutError:
            log.warning("%s passed %.1f s", where, self.limits.tool_timeout_s)
            raise _Ends("tool_timeout", seconds=self.limits.tool_timeout_s) from None
        except Exception as exc:  # noqa: BLE001 - the tool's failure ends its episode, recorded with it
            log.warning("%s failed: %r", where, exc)
            raise _Ends("tool_error", message=repr(exc)) from exc
        finally:
            episode.timed("tool", began)
        if not isinstance(answer, (Observation, Done)):  # the environment's code is wrong, not its tool: loud
            raise TypeError(f"{self.environment.__name__}.step returned {answer!r}: return an Observation or Done")
        return answer


class EngineRejectedAll(RuntimeError):
    """Every episode of a rollout call ended `engine_rejected`: a misconfigured run, not an episode."""


class _Ends(Exception):
    """Ends an episode with `reason` (and its detail) and reward `failed_reward`."""

    def __init__(self, reason: str, **detail):
        super().__init__(reason)
        self.reason, self.detail = reason, detail


async def _step(env, turn: Turn):
    """The environment's answer to a turn: a coroutine awaited, a plain method on a thread."""
    if inspect.iscoroutinefunction(env.step):
        return await env.step(turn)
    return await asyncio.to_thread(env.step, turn)
