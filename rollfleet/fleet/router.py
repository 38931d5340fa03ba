"""Spread generate requests over engines: least outstanding requests first; when an engine dies
mid-request, the request goes to another engine, and the caller gets each result exactly once
(only the answer of the attempt that succeeded is kept)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import httpx

from rollfleet.engine.client import EngineClient, EngineError

log = logging.getLogger("rollfleet.router")


class NoEngineAvailable(RuntimeError):
    pass


@dataclass
class EngineSlot:
    """The router's view of one engine."""

    engine_id: int
    url: str
    head: Any  # the RolloutWorker actor that owns the engine process
    alive: bool = True
    outstanding: int = 0


class Router:
    def __init__(self, slots: list[EngineSlot], clients: dict[int, EngineClient]):
        self.slots, self.clients = slots, clients
        self.retries = 0

    def choose(self, exclude: set[int]) -> EngineSlot:
        candidates = [s for s in self.slots if s.alive and s.engine_id not in exclude]
        if not candidates:
            alive = [s.engine_id for s in self.slots if s.alive]
            raise NoEngineAvailable(f"no engine can take the request (alive engines: {alive}, "
                                    f"already tried: {sorted(exclude)})")
        return min(candidates, key=lambda s: (s.outstanding, s.engine_id))

    async def generate(self, payload: dict[str, Any]) -> tuple[list[dict], int]:
        """Send one /generate payload; returns its results (a list, also for n == 1) and the engine id."""
        tried: set[int] = set()
        while True:
            slot = self.choose(tried)
            slot.outstanding += 1
            try:
                out = await self.clients[slot.engine_id].generate(**payload)
                return (out if isinstance(out, list) else [out]), slot.engine_id
            except (httpx.TransportError, EngineError) as exc:
                if isinstance(exc, EngineError) and 400 <= exc.status_code < 500:
                    raise  # the request is bad, not the engine: another engine would refuse it too
                tried.add(slot.engine_id)
                await self._on_engine_failure(slot, exc)
                self.retries += 1
            finally:
                slot.outstanding -= 1

    async def _on_engine_failure(self, slot: EngineSlot, exc: Exception) -> None:
        alive = await slot.head.engine_alive.remote()
        if not alive and slot.alive:
            slot.alive = False
            log.warning("engine %d died (%r); its requests go to other engines", slot.engine_id, exc)
        else:
            log.warning("engine %d failed a request (%r); retrying elsewhere", slot.engine_id, exc)
