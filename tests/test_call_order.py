"""Numbered weight-update calls are queued in number order, whatever order they arrive in."""

from __future__ import annotations

import asyncio

import pytest

from rollfleet.engine.weights.call_order import CallOrder, CallOrderError


async def arrive(order: CallOrder, queued: list, sync_id, call, fail=False):
    async with order.turn(sync_id, call):
        if fail:
            raise ValueError("bad request")
        queued.append((sync_id, call))


async def waiting(order: CallOrder, count: int) -> None:
    """Until `count` calls wait for their turn (the order's own state, not time)."""
    async with asyncio.timeout(5):
        while order.waiting != count:
            await asyncio.sleep(0)


def test_calls_arriving_in_reverse_are_queued_in_order():
    async def go():
        order, queued, calls = CallOrder(wait_s=5), [], []
        for call in reversed(range(1, 5)):  # 4 arrives first and waits, then 3 ...
            calls.append(asyncio.ensure_future(arrive(order, queued, "s", call)))
            await waiting(order, len(calls))
        assert queued == []
        await arrive(order, queued, "s", 0)
        await asyncio.gather(*calls)
        return queued

    assert asyncio.run(go()) == [("s", call) for call in range(5)]


def test_unnumbered_calls_take_no_turn_and_half_numbered_ones_are_refused():
    async def go():
        order, queued = CallOrder(wait_s=5), []
        await arrive(order, queued, None, None)
        with pytest.raises(CallOrderError, match="give both"):
            await arrive(order, queued, "s", None)
        return queued

    assert asyncio.run(go()) == [(None, None)]


def test_a_missing_call_times_out_naming_it():
    async def go():
        order, queued = CallOrder(wait_s=0.2), []
        await arrive(order, queued, "s", 0)
        with pytest.raises(CallOrderError, match="call 1 of that sync did not arrive within 0.2 s"):
            await arrive(order, queued, "s", 2)

    asyncio.run(go())


def test_a_new_sync_ends_the_waits_of_the_old_one():
    async def go():
        order, queued = CallOrder(wait_s=5), []
        await arrive(order, queued, "old", 0)
        stranded = asyncio.ensure_future(arrive(order, queued, "old", 2))  # call 1 never comes
        await waiting(order, 1)
        await arrive(order, queued, "new", 0)
        with pytest.raises(CallOrderError, match="that sync is over"):
            await stranded
        await arrive(order, queued, "new", 1)
        return queued

    assert asyncio.run(go()) == [("old", 0), ("new", 0), ("new", 1)]


def test_a_call_refused_before_it_was_queued_refuses_the_rest_of_its_sync():
    """A later call would otherwise receive the refused call's broadcast."""

    async def go():
        order, queued = CallOrder(wait_s=5), []
        await arrive(order, queued, "s", 0)
        with pytest.raises(ValueError, match="bad request"):
            await arrive(order, queued, "s", 1, fail=True)
        with pytest.raises(CallOrderError, match="call 1 was refused before it ran"):
            await arrive(order, queued, "s", 2)
        await arrive(order, queued, "next", 0)  # a new sync starts clean
        return queued

    assert asyncio.run(go()) == [("s", 0), ("next", 0)]
