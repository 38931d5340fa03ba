"""In-flight weight updates on a real server (SGLang's pause modes), and `meta_info.weight_versions`.

A request paused in place or retracted while a push applies goes on after /continue_generation
with the new weights: its answer carries two version spans, and the tokens after the update are
exactly what a fresh request on the new weights gives from the same prefix (the engine recomputes
the prefix's KV cache). A pause without an update changes no output; "abort" ends the request.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from conftest import call, client_for, held_in_flight, reference_greedy, run, scheduler_stats_when
from safetensors.torch import load_file

from rollfleet.wire.buckets import iter_buckets
from rollfleet.wire.serialize import serialize

PROMPT = [1, 2, 3]
TOKENS = 120
LONG = {"max_new_tokens": TOKENS, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def server(qwen3_server):
    """conftest's plain qwen3 server, shared with the other engine modules (reset for each)."""
    return qwen3_server


@pytest.fixture
def engine(server, qwen3_dir):
    """The server generating at qwen3_dir's weights, version "default"."""
    httpx.post(server.url + "/continue_generation", json={}, timeout=60)
    call(server, "update_weights_from_disk", qwen3_dir, weight_version="default")
    return server


MADE = 5  # tokens a request has made when a test acts on it


async def _mid_request(client, rid: str) -> asyncio.Task:
    """A long greedy request in the running batch with exactly MADE tokens, held there (paused in place)."""
    return await held_in_flight(
        client, steps=MADE, input_ids=PROMPT, sampling_params=LONG, rid=rid, return_logprob=True
    )


async def _fresh_from(client, out: dict, start: int) -> dict:
    """What the engine's current weights give from the prompt plus `out`'s first `start` tokens."""
    left = TOKENS - start
    prefix = PROMPT + out["output_ids"][:start]
    return await client.generate(
        input_ids=prefix, sampling_params={**LONG, "max_new_tokens": left}, return_logprob=True
    )


def _logprobs(out: dict) -> list[float]:
    return [entry[0] for entry in out["meta_info"]["output_token_logprobs"]]


def _push_session(proc, model_dir: str, version: str) -> None:
    """A complete weight-update session of `model_dir`'s tensors (SGLang >= 0.5.21's tensor sync)."""
    tensors = load_file(f"{model_dir}/model.safetensors")
    call(proc, "begin_weight_update")
    payload = serialize([b.to_payload() for b in iter_buckets(tensors.items(), 64 * 1024)])
    call(proc, "update_weights_from_tensor", [payload], load_format="flattened_bucket", weight_version=version)
    call(proc, "end_weight_update")


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_update_under_a_pause_continues_with_the_new_weights(engine, mode, qwen3_dir, qwen3_dir_b):
    async def go():
        async with client_for(engine) as client:
            task = await _mid_request(client, f"inflight-{mode}")
            await client.pause_generation(mode)
            paused = (await client.get_server_info())["scheduler_stats"]
            if mode == "in_place":
                await client.update_weights_from_disk(qwen3_dir_b, weight_version="b")
            else:
                await asyncio.to_thread(_push_session, engine, qwen3_dir_b, "b")
            await client.continue_generation()
            out = await task
            start = out["meta_info"]["weight_versions"][0]["end"]
            after = (await client.get_server_info())["scheduler_stats"]
            return paused, out, await _fresh_from(client, out, start), after

    paused, out, fresh, after = run(go())
    spans = out["meta_info"]["weight_versions"]
    start = spans[0]["end"]
    assert start == MADE, spans
    assert spans == [
        {"version": "default", "start": 0, "end": start},
        {"version": "b", "start": start, "end": TOKENS},
    ]
    assert out["meta_info"]["weight_version"] == "b"
    # retract puts the running request back in the queue; in place keeps it in the batch
    expected = (0, 1) if mode == "retract" else (1, 0)
    assert (paused["running_requests"], paused["waiting_requests"]) == expected
    assert out["output_ids"][:start] == reference_greedy(qwen3_dir, PROMPT, start)[0]
    assert out["output_ids"][start:] == fresh["output_ids"]
    assert _logprobs(out)[start:] == pytest.approx(_logprobs(fresh), abs=1e-5)
    assert after["recomputed_prefixes"] == paused["recomputed_prefixes"] + 1


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_a_pause_without_an_update_changes_no_output(engine, mode):
    async def go():
        async with client_for(engine) as client:
            plain = await client.generate(input_ids=PROMPT, sampling_params=LONG, return_logprob=True)
            task = await _mid_request(client, f"still-{mode}")
            await client.pause_generation(mode)
            await client.continue_generation()
            return plain, await task

    plain, paused = run(go())
    assert paused["output_ids"] == plain["output_ids"]
    assert paused["meta_info"]["weight_versions"] == [{"version": "default", "start": 0, "end": TOKENS}]
    # in place keeps the KV cache: the very same numbers; retract recomputes it from the same weights
    if mode == "in_place":
        assert _logprobs(paused) == _logprobs(plain)
    else:
        assert _logprobs(paused) == pytest.approx(_logprobs(plain), abs=1e-5)


def test_abort_mode_ends_the_request_and_a_queued_one_runs_on_the_new_weights(engine, qwen3_dir_b):
    async def go():
        async with client_for(engine) as client:
            task = await _mid_request(client, "doomed")
            await client.pause_generation("abort")
            aborted = await task  # answered by the time pause_generation returns
            queued = asyncio.create_task(client.generate(input_ids=PROMPT, sampling_params=LONG, rid="queued"))
            await scheduler_stats_when(client, lambda s: s["waiting_requests"] == 1)
            await client.update_weights_from_disk(qwen3_dir_b, weight_version="b")
            await client.continue_generation()
            return aborted, await queued

    aborted, queued = run(go())
    made = len(aborted["output_ids"])
    assert aborted["meta_info"]["finish_reason"]["type"] == "abort" and made == MADE
    assert aborted["meta_info"]["weight_versions"] == [{"version": "default", "start": 0, "end": made}]
    assert queued["meta_info"]["weight_versions"] == [{"version": "b", "start": 0, "end": TOKENS}]


def test_a_version_label_change_alone_splits_the_spans(engine):
    """/update_weight_version under a pause (no new weights): spans split, nothing is recomputed."""

    async def go():
        async with client_for(engine) as client:
            task = await _mid_request(client, "relabelled")
            await client.pause_generation("in_place")
            before = (await client.get_server_info())["scheduler_stats"]["recomputed_prefixes"]
            await client.update_weight_version("v2")
            await client.continue_generation()
            out = await task
            return out, before, (await client.get_server_info())["scheduler_stats"]["recomputed_prefixes"]

    out, before, after = run(go())
    spans = out["meta_info"]["weight_versions"]
    assert [s["version"] for s in spans] == ["default", "v2"] and spans[1]["end"] == TOKENS
    assert after == before


def test_only_the_finished_stream_event_carries_weight_versions(engine):
    body = {"input_ids": PROMPT, "sampling_params": {**LONG, "max_new_tokens": 4}, "stream": True}
    text = httpx.post(engine.url + "/generate", json=body, timeout=60).text
    chunks = [json.loads(c.removeprefix("data: ")) for c in text.split("\n\n") if c and c != "data: [DONE]"]
    assert [("weight_versions" in c["meta_info"]) for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert chunks[-1]["meta_info"]["weight_versions"] == [{"version": "default", "start": 0, "end": 4}]


def test_the_client_refuses_an_unknown_pause_mode_before_sending():
    from rollfleet.wire.client import EngineClient

    async def go():
        async with EngineClient("http://127.0.0.1:9") as client:  # nothing listens: no request is sent
            await client.pause_generation("sideways")

    with pytest.raises(ValueError, match="mode='sideways'.*in_place"):
        run(go())


def test_a_sample_keeps_the_answer_s_version_spans():
    from rollfleet.sample import Sample

    spans = [{"version": "1", "start": 0, "end": 2}, {"version": "2", "start": 2, "end": 3}]
    out = {"output_ids": [5, 6, 7], "meta_info": {"finish_reason": {"type": "length"}, "weight_version": "2"}}
    out["meta_info"]["weight_versions"] = spans
    sample = Sample.from_answer(0, 0, [1], out, engine_id=3)
    assert sample.weight_versions == spans and sample.weight_version == "2"
