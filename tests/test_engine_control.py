"""Abort, pause (abort / in_place) and continue on a real server (retract and weight updates under
a pause: test_engine_inflight.py)."""

from __future__ import annotations

import asyncio

import pytest
from conftest import client_for, engine_turns, held_in_flight, run, scheduler_stats_when

from rollfleet.wire.client import EngineError

LONG = {"max_new_tokens": 400, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def server(qwen3_server):
    """conftest's plain qwen3 server, shared with the other engine modules (reset for each)."""
    return qwen3_server


async def _started(client, rid):
    """A long request in the running batch (not queued) with one token, held in place so it cannot finish on its own."""
    return await held_in_flight(client, input_ids=[1, 2, 3], sampling_params=LONG, rid=rid)


def test_abort_one_request_by_rid(server):
    async def go():
        async with client_for(server) as client:
            doomed = await _started(client, "doomed")
            other = asyncio.create_task(client.generate(input_ids=[4], sampling_params={"max_new_tokens": 3}))
            await client.abort_request("doomed")
            doomed = await doomed
            await client.continue_generation()
            return doomed, await other

    doomed, other = run(go())
    assert doomed["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(doomed["output_ids"]) < 400
    assert other["meta_info"]["finish_reason"]["type"] != "abort"


def test_abort_all(server):
    async def go():
        async with client_for(server) as client:
            tasks = [await _started(client, "r0")]
            tasks.append(asyncio.create_task(client.generate(input_ids=[7], sampling_params=LONG, rid="r1")))
            await scheduler_stats_when(client, lambda s: s["waiting_requests"] == 1)  # r1 queued, r0 paused
            await client.abort_request(abort_all=True)
            outs = await asyncio.gather(*tasks)
            await client.continue_generation()
            return outs

    assert all(o["meta_info"]["finish_reason"]["type"] == "abort" for o in run(go()))


def test_pause_abort_mode_aborts_in_flight_and_holds_new_requests(server):
    async def go():
        async with client_for(server) as client:
            running = await _started(client, "p1")
            await client.pause_generation("abort")
            aborted = await running
            later = asyncio.create_task(
                client.generate(input_ids=[5], sampling_params={"max_new_tokens": 2, "ignore_eos": True})
            )
            await scheduler_stats_when(client, lambda s: s["waiting_requests"] == 1)
            await engine_turns(client)  # the claim: held, not merely slow to start
            stats = (await client.get_server_info())["scheduler_stats"]
            held = not later.done() and stats["waiting_requests"] == 1 and stats["running_requests"] == 0
            await client.continue_generation()
            return aborted, held, await later

    aborted, held, later = run(go())
    assert aborted["meta_info"]["finish_reason"]["type"] == "abort"
    assert held and later["meta_info"]["finish_reason"]["type"] == "length"


def test_pause_in_place_keeps_requests_and_continue_finishes_them(server):
    async def go():
        async with client_for(server) as client:
            task = await _started(client, "kept")
            progress = (await client.get_server_info())["scheduler_stats"]["generated_tokens"]
            await engine_turns(client)  # the claim: the engine thread chose its work and made no token
            stats = (await client.get_server_info())["scheduler_stats"]
            still = stats["generated_tokens"]
            stalled = not task.done() and stats["running_requests"] == 1
            await client.continue_generation()
            return stalled, progress == still, await task

    stalled, frozen, out = run(go())
    assert stalled and frozen
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 400}


def test_release_memory_refused_while_requests_run(server):
    async def go():
        async with client_for(server) as client:
            task = await _started(client, "busy")
            try:
                await client.release_memory_occupation(["kv_cache"])
            except EngineError as exc:
                error = exc
            else:
                error = None
            await client.abort_request("busy")
            await client.continue_generation()
            await task
            return error

    error = run(go())
    assert error is not None and error.status_code == 400 and "unfinished" in error.message


def test_client_timeout_raises_engine_timeout(server):
    from rollfleet.wire.client import EngineClient, EngineTimeout

    async def go():
        async with client_for(server) as control:
            await control.pause_generation("in_place")  # the request cannot finish: the timeout must end the call
            try:
                async with EngineClient(server.url, timeout=0.05) as client:
                    await client.generate(input_ids=[1, 2, 3], sampling_params=LONG, rid="slow")
            finally:
                await control.abort_request("slow")
                await control.continue_generation()

    with pytest.raises(EngineTimeout):
        run(go())


def test_step_runs_exactly_the_steps_asked_while_paused_then_holds(server):
    async def go():
        async with client_for(server) as client:
            task = await _started(client, "stepped")  # one step: the batch's prefill, one token
            first = (await client.get_server_info())["scheduler_stats"]
            three = await client.step(3)
            await engine_turns(client)
            held = (await client.get_server_info())["scheduler_stats"]
            await client.continue_generation()
            return first, three, held, await task

    first, three, held, out = run(go())
    assert first["paused"] is True and first["held"] is None and first["running_requests"] == 1
    assert three["steps_run"] == 3 and three["scheduler_stats"]["steps_left"] == 0
    assert three["scheduler_stats"]["generated_tokens"] == first["generated_tokens"] + 3
    assert held["generated_tokens"] == first["generated_tokens"] + 3 and held["running_requests"] == 1
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 400}


def test_step_answers_early_when_the_batch_finishes_and_is_refused_unless_paused(server):
    async def go():
        async with client_for(server) as client:
            short = {"max_new_tokens": 2, "ignore_eos": True, "temperature": 0}
            task = await held_in_flight(client, input_ids=[1, 2, 3], sampling_params=short)
            rest = await client.step(10)  # one more token ends it
            done = await task
            idle = await client.step(1)  # nothing to run: answered at once
            await client.continue_generation()
            try:
                await client.step(1)
            except EngineError as exc:
                return rest, done, idle, exc
            return rest, done, idle, None

    rest, done, idle, refused = run(go())
    assert rest["steps_run"] == 1 and done["meta_info"]["finish_reason"] == {"type": "length", "length": 2}
    assert idle["steps_run"] == 0 and idle["scheduler_stats"]["running_requests"] == 0
    assert refused is not None and refused.status_code == 400 and "not paused" in refused.message
