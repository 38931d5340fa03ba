"""EnginePool: the one way driver code calls engines.

One `EngineClient` per engine (by engine id), all living on one event-loop thread of the pool.
Synchronous code (the fleet's verbs, weight senders, recovery threads) blocks on futures of that
loop; async code (the router's generate requests) runs on it. An engine restarted on a new port gets
a new client (`set_url`); the old one is closed.

    pool = EnginePool(api_key=key, admin_api_key=admin_key, timeout=600)
    pool.set_url(0, "http://127.0.0.1:30000")
    info = pool.call(0, "get_model_info")
    answers = pool.each("update_weight_version", {0: (("v1",), {})}).result()
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Iterable, Mapping
from concurrent.futures import Future
from typing import Any

from rollfleet.wire.client import EngineClient


class EnginePool:
    def __init__(self, *, api_key: str | None = None, admin_api_key: str | None = None, timeout: float = 600.0):
        """The keys are the servers' --api-key and --admin-api-key; each call carries the one its route takes."""
        self.api_key, self.admin_api_key, self.timeout = api_key, admin_api_key, timeout
        self._clients: dict[int, EngineClient] = {}
        self._lock = threading.Lock()  # set_url may run in several driver threads (restarts, probes)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="rollfleet-engine-pool", daemon=True)
        self._thread.start()

    @classmethod
    def for_urls(
        cls,
        urls: Mapping[int, str],
        *,
        api_key: str | None = None,
        admin_api_key: str | None = None,
        timeout: float = 600.0,
    ) -> EnginePool:
        pool = cls(api_key=api_key, admin_api_key=admin_api_key, timeout=timeout)
        for engine_id, url in urls.items():
            pool.set_url(engine_id, url)
        return pool

    # ---- which engines --------------------------------------------------------------------------
    def set_url(self, engine_id: int, url: str) -> None:
        """Where engine `engine_id` answers now; a changed url replaces (and closes) its client."""
        with self._lock:
            old = self._clients.get(engine_id)
            if old is not None and old.base_url == url.rstrip("/"):
                return
            self._clients[engine_id] = EngineClient(
                url, api_key=self.api_key, admin_api_key=self.admin_api_key, timeout=self.timeout
            )
        if old is not None:
            self.submit(old.close())

    def client(self, engine_id: int) -> EngineClient:
        """The engine's client, for coroutines that run on this pool's loop (`submit`, `run`)."""
        try:
            return self._clients[engine_id]
        except KeyError:
            raise KeyError(
                f"engine_id={engine_id}: the pool has no url for it (known: {sorted(self._clients)}); "
                "call set_url(engine_id, url) first"
            ) from None

    # ---- calls ----------------------------------------------------------------------------------
    def submit(self, coro: Coroutine) -> Future:
        """Run a coroutine on the pool's loop; a future of its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def run(self, coro: Coroutine) -> Any:
        """Run a coroutine on the pool's loop and wait for its result (not from the loop's own thread)."""
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("EnginePool.run called on the pool's own loop: await the coroutine instead")
        return self.submit(coro).result()

    def call(self, engine_id: int, verb: str, *args, **kwargs) -> Any:
        """One client call, waited for."""
        return self.run(getattr(self.client(engine_id), verb)(*args, **kwargs))

    def each(self, verb: str, arguments: Mapping[int, tuple[tuple, dict]]) -> Future:
        """`verb` on every engine of `arguments` (engine id -> (args, kwargs)) at once; a future of the
        answers in `arguments`' order. The first error fails the future once every call has ended."""
        calls = [(self.client(e), args, kwargs) for e, (args, kwargs) in arguments.items()]

        async def go():
            answers = await asyncio.gather(
                *(getattr(client, verb)(*args, **kwargs) for client, args, kwargs in calls), return_exceptions=True
            )
            error = next((a for a in answers if isinstance(a, BaseException)), None)
            if error is not None:
                raise error
            return answers

        return self.submit(go())

    def on_all(self, verb: str, engine_ids: Iterable[int], *args, **kwargs) -> list:
        """The same call on every engine of `engine_ids`, concurrently; their answers in that order."""
        return self.each(verb, {e: (args, kwargs) for e in engine_ids}).result()

    def close(self) -> None:
        async def close_all():
            await asyncio.gather(*(c.close() for c in self._clients.values()))

        if self._thread.is_alive():
            self.submit(close_all()).result()
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
