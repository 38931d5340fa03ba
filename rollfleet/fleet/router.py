"""Spread generate requests over engines: least outstanding requests first; when an engine dies
mid-request, the request goes to another engine, and the caller gets each result exactly once
(only the answer of the attempt that succeeded is kept)."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from rollfleet.fleet.health import EngineState, Lifecycle
from rollfleet.wire.client import EngineClient, EngineError

log = logging.getLogger("rollfleet.router")


class NoEngineAvailable(RuntimeError):
    pass


RUNNING = (EngineState.ACTIVE, EngineState.SLEEPING, EngineState.AWAITING_WEIGHTS)


@dataclass
class EngineSlot:
    """The router's view of one engine."""

    engine_id: int
    url: str
    head: Any  # the RolloutWorker actor that owns the engine process
    gpu_ids: list[str] = field(default_factory=list)
    version: str = "default"
    dtype: str | None = None  # parameter dtype as the engine reports it (asked once)
    outstanding: int = 0
    lifecycle: Lifecycle = None  # set in __post_init__

    def __post_init__(self):
        if self.lifecycle is None:
            self.lifecycle = Lifecycle(self.engine_id)

    @property
    def state(self) -> EngineState:
        return self.lifecycle.state

    @property
    def is_running(self) -> bool:
        """The process is up and reachable (it may not serve generate)."""
        return self.state in RUNNING


class Router:
    def __init__(
        self,
        slots: list[EngineSlot],
        version: str,
        *,
        api_key: str | None = None,
        timeout: float = 600.0,
        wait_s: float = 0.0,
    ):
        self.slots, self.version, self.wait_s = slots, version, wait_s
        self.api_key, self.timeout = api_key, timeout
        self.clients: dict[int, EngineClient] = {}
        self.retries = 0

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self.clients.values()))

    def serving(self, exclude: set[int]) -> list[EngineSlot]:
        """ACTIVE engines at the fleet's weight version: the only ones that get generate traffic."""
        return [
            s
            for s in self.slots
            if s.state == EngineState.ACTIVE and s.version == self.version and s.engine_id not in exclude
        ]

    async def choose(self, exclude: set[int]) -> EngineSlot:
        """The least busy serving engine; with none, wait up to `wait_s` for one (recovery)."""
        deadline = time.monotonic() + self.wait_s
        while not self.serving(exclude):
            if time.monotonic() >= deadline:
                states = {s.engine_id: s.state.value for s in self.slots}
                raise NoEngineAvailable(
                    f"no ACTIVE engine at weight version {self.version!r} within "
                    f"{self.wait_s:.0f} s (states: {states}, already tried: {sorted(exclude)}); "
                    "restart engines (Fleet.restart_inactive) or raise rollout.recovery_wait_s"
                )
            await asyncio.sleep(0.1)
            exclude = {
                e for e in exclude if any(s.engine_id == e and s.state == EngineState.INACTIVE for s in self.slots)
            }  # a recovered engine may be retried
        return min(self.serving(exclude), key=lambda s: (s.outstanding, s.engine_id))

    async def generate(self, payload: dict[str, Any]) -> tuple[list[dict], int]:
        """Send one /generate payload; returns its results (a list, also for n == 1) and the engine id."""
        tried: set[int] = set()
        while True:
            slot = await self.choose(tried)
            slot.outstanding += 1
            try:
                out = await self._client(slot).generate(**payload)
                return (out if isinstance(out, list) else [out]), slot.engine_id
            except (httpx.TransportError, EngineError) as exc:
                if isinstance(exc, EngineError) and 400 <= exc.status_code < 500:
                    raise  # the request is bad, not the engine: another engine would refuse it too
                tried.add(slot.engine_id)
                await self._on_engine_failure(slot, exc)
                self.retries += 1
            finally:
                slot.outstanding -= 1

    def _client(self, slot: EngineSlot) -> EngineClient:
        client = self.clients.get(slot.engine_id)
        if client is None or client.base_url != slot.url.rstrip("/"):  # a restarted engine has a new port
            client = self.clients[slot.engine_id] = EngineClient(slot.url, api_key=self.api_key, timeout=self.timeout)
        return client

    async def _on_engine_failure(self, slot: EngineSlot, exc: Exception) -> None:
        alive = await slot.head.engine_alive.remote()
        if not alive and slot.state != EngineState.INACTIVE and slot.state != EngineState.RECOVERING:
            slot.lifecycle.to(EngineState.INACTIVE, f"process exited ({exc!r})")
        log.warning("engine %d failed a request (%r); retrying elsewhere", slot.engine_id, exc)
