"""Numbered weight-update calls run in their numbers' order, whatever order their requests arrive in
(a rollfleet extension of /update_weights_from_distributed).

An engine receives a call's broadcast when it runs the call, so its calls must run in the order
the sender broadcasts. Without numbers a sender can have one call in flight: it announces call
k+1 only after the engine answered call k. With numbers it announces ahead, and the HTTP round
trip and the engine's per-call work overlap the previous call's transfer.

A call is `(sync_id, call)` with calls numbered 0, 1, 2, ...; call 0 starts a sync and ends the
previous one. A call waits for its turn (the previous number of the same sync has been queued on
the engine thread, which runs what it queues in order); a call of an ended sync, one whose turn
does not come within `wait_s`, or one after a call refused before it was queued is refused with
the reason named. SGLang has no such fields (it ignores them), so
senders number calls only for engines that advertise `rollfleet_ordered_weight_calls`.
"""

from __future__ import annotations

import asyncio
from collections import deque
from contextlib import asynccontextmanager


class CallOrderError(ValueError):
    pass


class CallOrder:
    def __init__(self, wait_s: float = 120.0):
        self.wait_s = wait_s
        self.sync_id: str | None = None
        self.next_call = 0
        self.broken: str | None = None  # why the current sync's later calls are refused
        self.ended: deque[str | None] = deque(maxlen=64)  # syncs a newer one replaced
        self.waiting = 0  # numbered calls waiting for their turn now
        self._changed = asyncio.Condition()

    @asynccontextmanager
    async def turn(self, sync_id: str | None, call: int | None):
        """Hold the turn of call `call` of `sync_id` while the caller queues its work; an unnumbered
        call (both None) takes no turn."""
        if sync_id is None and call is None:
            yield
            return
        if sync_id is None or call is None:
            raise CallOrderError(
                f"rollfleet_sync_id={sync_id!r}, rollfleet_call={call!r}: give both (a numbered call) or neither"
            )
        async with self._changed:
            if call == 0:
                self.ended.append(self.sync_id)
                self.sync_id, self.next_call, self.broken = sync_id, 0, None
                self._changed.notify_all()  # waiters of an older sync learn that it is over
            self.waiting += 1
            try:  # a call may also arrive before its sync's call 0
                await asyncio.wait_for(
                    self._changed.wait_for(
                        lambda: sync_id in self.ended or (self.sync_id == sync_id and self.next_call == call)
                    ),
                    self.wait_s,
                )
            except TimeoutError:
                raise CallOrderError(
                    f"rollfleet_call={call} of sync {sync_id!r}: call {self.next_call} of that "
                    f"sync did not arrive within {self.wait_s:g} s; the sender must send every "
                    "call, numbered from 0"
                ) from None
            finally:
                self.waiting -= 1
            if sync_id in self.ended:
                raise CallOrderError(
                    f"rollfleet_call={call} of sync {sync_id!r}: that sync is over (sync "
                    f"{self.sync_id!r} has started); number a new sync's calls from 0"
                )
            if self.broken is not None:
                self.next_call = call + 1
                self._changed.notify_all()
                raise CallOrderError(f"rollfleet_call={call} of sync {sync_id!r} refused: {self.broken}")
            try:
                yield
            except BaseException as exc:
                # the call was not queued, so it will not receive its broadcast: a later call would
                # receive it instead
                self.broken = f"call {call} was refused before it ran ({exc}); the rest of the sync cannot follow it"
                raise
            finally:
                self.next_call = call + 1
                self._changed.notify_all()
