"""Requests to generate that the HTTP side is reading: the arrival wave, admitted as one batch.

A GRPO step sends its prompts at once, one /generate each. The server reads them one after another
(body, schema, checks) on one event loop, while the engine thread starts a step as soon as one is
queued. Left alone, the wave is admitted piecemeal: on the CPU bench (64 requests x 8 samples) in
25-37 prefill steps instead of one, each stalling the rows already decoding, which then finish
apart (152-214 decode steps instead of 127 for the same tokens).

So the HTTP side counts the generation requests it has begun to read and not yet queued or refused
(`CountArrivals`, an ASGI middleware, counts; `submit_generate` marks its request queued), and an
idle engine (nothing running) waits to start a new batch while that count is above zero, at most
`--rollfleet-arrival-wait-ms` from the first request it held back. A request counts until three
turns of the server's event loop after it is queued (`mark_queued` says why), so a lone request on
an idle engine waits those turns (1-2 ms on a loaded 2-core CPU; not measured on a quiet host). A
running batch is never held: requests join it as before.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
import time

# the arrival of the request this task serves (set by CountArrivals, marked queued by submit_generate)
CURRENT: contextvars.ContextVar[Arrival | None] = contextvars.ContextVar("rollfleet_arrival", default=None)
# the routes that queue generation (SGLang's, and the OpenAI ones over the same queue)
GENERATION_PATHS = frozenset({"/generate", "/v1/completions", "/v1/chat/completions"})


class Arrivals:
    """How many generation requests are being read, and how long an idle engine may wait for them."""

    def __init__(self, changed: threading.Condition, wait_s: float):
        self.changed, self.wait_s = changed, wait_s  # the scheduler's condition: a change wakes its thread
        self.reading = 0
        self._since: float | None = None  # when the current wait began (engine thread, under `changed`)
        self.holds, self.held_s = 0, 0.0  # waves held back, and for how long in all (the scheduler's stats)

    def begin(self) -> Arrival:
        with self.changed:
            self.reading += 1
        return Arrival(self)

    def hold_back(self) -> bool:
        """Whether an idle engine waits before it starts a batch of the queued requests (under
        `changed`): others are still being read, and the wait that began with the first held back is
        not over."""
        if self.reading == 0 or self.wait_s <= 0:
            self.over()
            return False
        now = time.monotonic()
        if self._since is None:
            self._since = now
            self.holds += 1
        return now < self._since + self.wait_s

    def over(self) -> None:
        """The wave is read, or a batch started: the wait (if any) ends, the next one starts afresh
        (under `changed`)."""
        if self._since is not None:
            self.held_s += time.monotonic() - self._since
            self._since = None

    def wait_timeout(self, idle: float) -> float:
        """How long the engine thread sleeps when it found nothing to run (under `changed`): until
        the current wait ends, when one runs."""
        left = idle if self._since is None else self._since + self.wait_s - time.monotonic()
        return idle if left <= 0 else min(idle, left)

    def _done(self) -> None:
        with self.changed:
            self.reading -= 1
            self.changed.notify()


class Arrival:
    """One request being read; `queued()` (or the end of the request) ends its count, once."""

    def __init__(self, arrivals: Arrivals):
        self._arrivals, self._counted = arrivals, True

    def queued(self) -> None:
        if self._counted:
            self._counted = False
            self._arrivals._done()


def mark_queued() -> None:
    """The request this task serves is queued or refused: it stops holding an idle engine back three
    turns of the event loop from now (on the loop's thread). The requests of a wave already sent
    count by then: a turn reads their bytes (the server's protocol schedules each one's handling),
    the next starts that handling, which counts it first thing (`CountArrivals`). Counted off at
    once, a wave whose requests come one after another never held the engine: each one was queued
    before the next began."""
    arrival = CURRENT.get()
    if arrival is not None:
        loop = asyncio.get_running_loop()
        loop.call_soon(loop.call_soon, loop.call_soon, arrival.queued)


class CountArrivals:
    """ASGI middleware: every POST to a generation route counts as arriving from its first byte until
    it is queued (`mark_queued`) or its handling ends, whichever is first."""

    def __init__(self, app, arrivals: Arrivals):
        self.app, self.arrivals = app, arrivals

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in GENERATION_PATHS:
            return await self.app(scope, receive, send)
        arrival = self.arrivals.begin()
        token = CURRENT.set(arrival)
        try:
            await self.app(scope, receive, send)
        finally:
            arrival.queued()
            CURRENT.reset(token)
