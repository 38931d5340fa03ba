"""Spread generate requests over engines: least outstanding requests first; when an engine dies
mid-request, the request goes to another engine, and the caller gets each result exactly once
(only the answer of the attempt that succeeded is kept). Runs on the engine pool's loop, with the
pool's clients.

A retry restarts the sample from scratch (the original payload: prompt only; the failed attempt's
tokens are dropped), and only on an ACTIVE engine at the requested weight version. The router never
continues a partial sample, so no sample's continuation reaches an engine at another version: a
sample's version spans (`meta_info.weight_versions`) come from one engine, and change only where that
engine took an in-flight weight update. An episode's turn (rollfleet.agents) is one such request: its
payload is the episode's ids so far, so a retry restarts that turn from the same ids; `prefer` sends
it to the engine of the episode's previous turn while that one serves."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from rollfleet.fleet.lifecycle import FAILED, EngineSlot, EngineState
from rollfleet.wire.client import EngineError, EngineUnreachable
from rollfleet.wire.pool import EnginePool

log = logging.getLogger("rollfleet.router")


class NoEngineAvailable(RuntimeError):
    pass


class Router:
    def __init__(
        self,
        slots: list[EngineSlot],
        pool: EnginePool,
        *,
        wait_s: float = 0.0,
        on_dead: Callable[[EngineSlot, str], None] | None = None,
    ):
        """`on_dead(slot, why)`: called when a failed request finds the engine's process gone."""
        self.slots, self.pool, self.wait_s, self.on_dead = slots, pool, wait_s, on_dead
        self.retries = 0  # requests sent again after an engine failed them (for the run's metrics)
        self.waiting_requests = 0  # requests held in `choose` now: no engine serves their version

    def serving(self, version: str, exclude: set[int]) -> list[EngineSlot]:
        """ACTIVE engines at the fleet's weight version: the only ones that get generate traffic."""
        return [
            s
            for s in self.slots
            if s.state == EngineState.ACTIVE and s.version == version and s.engine_id not in exclude
        ]

    async def choose(
        self, version: str, exclude: set[int], refused: frozenset[int] = frozenset(), prefer: int | None = None
    ) -> EngineSlot:
        """The least busy serving engine, or `prefer` while it serves (an episode's next turn goes to
        the engine that holds its prefix); with none, wait up to `wait_s` for one (recovery). Engines
        in `exclude` that recover may be tried again; those in `refused` (they answered this request
        with an engine-side error while alive) are not."""
        deadline = time.monotonic() + self.wait_s
        exclude = exclude | refused
        preferred = [s for s in self.serving(version, exclude) if s.engine_id == prefer]
        if preferred:
            return preferred[0]
        if self.serving(version, exclude):
            return min(self.serving(version, exclude), key=lambda s: (s.outstanding, s.engine_id))
        self.waiting_requests += 1
        try:
            while not self.serving(version, exclude):
                if time.monotonic() >= deadline:
                    states = {s.engine_id: s.state.value for s in self.slots}
                    raise NoEngineAvailable(
                        f"no ACTIVE engine at weight version {version!r} within "
                        f"{self.wait_s:.0f} s (states: {states}, already tried: {sorted(exclude)}); "
                        "restart engines (Fleet.restart_inactive) or raise rollout.recovery_wait_s"
                    )
                await asyncio.sleep(0.1)
                exclude = {
                    e for e in exclude if self.slots[e].state in FAILED
                } | refused  # a recovered engine may be retried
        finally:
            self.waiting_requests -= 1
        return min(self.serving(version, exclude), key=lambda s: (s.outstanding, s.engine_id))

    async def generate(
        self, payload: dict[str, Any], version: str, prefer: int | None = None
    ) -> tuple[list[dict], int]:
        """Send one /generate payload to an engine at `version` (`prefer` when it serves); returns its
        results (a list, also for n == 1) and the engine id. A 4xx answer is the request's fault and
        is raised, not retried. An engine that fails the request while its process lives (a 5xx, a
        timeout) gets it at most once; when every live engine has refused it, its last error is
        raised. A request whose engine died goes to another one (and to the restarted one, once it is
        back), until `wait_s` passes with no engine to try."""
        tried: set[int] = set()  # their process died under the request: may be tried again once back
        refused: set[int] = set()  # alive, and failed this request: never again for it
        while True:
            slot = await self.choose(version, tried, frozenset(refused), prefer)
            slot.outstanding += 1
            try:
                out = await self.pool.client(slot.engine_id).generate(**payload)
                return (out if isinstance(out, list) else [out]), slot.engine_id
            except (EngineUnreachable, EngineError) as exc:
                if isinstance(exc, EngineError) and 400 <= exc.status_code < 500:
                    raise  # the request is bad, not the engine: another engine would refuse it too
                alive = await self._on_engine_failure(slot, exc)
                (refused if alive else tried).add(slot.engine_id)
                self.retries += 1
                live = {s.engine_id for s in self.slots if s.state not in FAILED and not s.standby}
                if live and live <= refused:
                    raise exc  # every live engine failed this very request: it is the request, not them
            finally:
                slot.outstanding -= 1

    async def _on_engine_failure(self, slot: EngineSlot, exc: Exception) -> bool:
        """Whether the engine's process still lives (a dead one is reported to `on_dead`)."""
        alive = await slot.head.engine_alive.remote()
        if not alive and self.on_dead is not None:
            self.on_dead(slot, f"process exited ({exc!r})")
        log.warning("engine %d failed a request (%r); retrying elsewhere", slot.engine_id, exc)
        return alive
