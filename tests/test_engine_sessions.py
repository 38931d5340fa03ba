"""Weight-update sessions on a real server: a sync is complete or it is not served.

begin_weight_update / end_weight_update (SGLang >= 0.5.21): calls inside a session apply per call
(all or none across ranks); end commits the held weight_version only when every tensor of the
model arrived and no call was refused. Otherwise the weights are mixed: not ready, generate
refused (503) until a complete session or a disk load. Also: a weight update waits for the
running batch.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch
from conftest import call, client_for, engine_server, reference_greedy, run, scheduler_stats_when
from safetensors.torch import load_file

from rollfleet.wire.buckets import iter_buckets
from rollfleet.wire.client import EngineError
from rollfleet.wire.serialize import serialize

PROMPT = [4, 8, 15, 16, 23, 42]
GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
BUCKET_BYTES = 48 * 1024  # several calls per sync on the tiny model
LONG = {"max_new_tokens": 400, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def server(qwen3_server):
    """conftest's plain qwen3 server, shared with the other engine modules (reset for each)."""
    return qwen3_server


@pytest.fixture
def engine(server, qwen3_dir):
    """The server at qwen3_dir's weights, version "a", no session open."""
    post(server, "/end_weight_update")  # a session a failed test left open
    call(server, "update_weights_from_disk", qwen3_dir, weight_version="a")
    return server


def post(proc, route: str, body: dict | None = None) -> httpx.Response:
    return httpx.post(proc.url + route, json={} if body is None else body, timeout=60)


def push(proc, tensors: dict, **kwargs) -> dict:
    """One /update_weights_from_tensor call carrying `tensors` as flattened buckets."""
    buckets = list(iter_buckets(tensors.items(), BUCKET_BYTES))
    payload = serialize([b.to_payload() for b in buckets])
    return call(proc, "update_weights_from_tensor", [payload], load_format="flattened_bucket", **kwargs)


def calls_of(tensors: dict, count: int) -> list[dict]:
    names = sorted(tensors)
    return [{name: tensors[name] for name in names[i::count]} for i in range(count)]


def version(proc) -> str:
    return call(proc, "get_model_info")["weight_version"]


def greedy(proc) -> list[int]:
    return call(proc, "generate", input_ids=PROMPT, sampling_params=GREEDY)["output_ids"]


def status(proc, route: str) -> int:
    return httpx.get(proc.url + route, timeout=60).status_code


def held_payloads(proc) -> int:
    return httpx.get(proc.url + "/rollfleet/memory", timeout=60).json()[0]["held_payloads"]


def assert_not_serving(proc):
    assert status(proc, "/health_generate") == 503
    assert call(proc, "get_model_info")["weights_ready"] is False
    with pytest.raises(EngineError) as err:
        greedy(proc)
    assert err.value.status_code == 503, err.value.message
    for part in ["mixed", "begin_weight_update", "/update_weights_from_disk"]:
        assert part in err.value.message, err.value.message


def test_a_complete_session_commits_its_version_at_the_end(engine, qwen3_dir_b):
    assert call(engine, "get_server_info")["rollfleet_weight_update_sessions"] is True
    new = load_file(f"{qwen3_dir_b}/model.safetensors")
    begun = post(engine, "/begin_weight_update", {"selector": "all"})
    assert begun.status_code == 200 and begun.json()["success"] is True
    first, *rest = calls_of(new, 3)
    push(engine, first, weight_version="b")
    assert version(engine) == "a"  # held: the session is not complete yet
    assert status(engine, "/health_generate") == 503  # a sync is in progress
    for tensors in rest:
        push(engine, tensors)
    assert held_payloads(engine) > 0  # the sender's buffers, kept mapped while its sync goes on
    ended = post(engine, "/end_weight_update")
    assert ended.status_code == 200, ended.text
    assert ended.json()["success"] is True and "'b'" in ended.json()["message"]
    # the sync ended: a colocated sender frees them before the engine's resume (else the two meet)
    assert held_payloads(engine) == 0
    assert version(engine) == "b" and status(engine, "/health_generate") == 200
    assert greedy(engine) == reference_greedy(qwen3_dir_b, PROMPT, 8)[0]


def test_a_session_missing_one_tensor_is_not_served_until_a_complete_one(engine, qwen3_dir_b):
    new = load_file(f"{qwen3_dir_b}/model.safetensors")
    left_out = "model.layers.1.mlp.down_proj.weight"
    assert post(engine, "/begin_weight_update").status_code == 200
    push(engine, {n: t for n, t in new.items() if n != left_out}, weight_version="b")
    ended = post(engine, "/end_weight_update")
    assert ended.status_code == 400 and ended.json()["success"] is False
    message = ended.json()["message"]
    assert left_out in message and "1 of the model's" in message, message
    assert version(engine) == "a"
    assert_not_serving(engine)
    # requests are refused, not queued, and a later complete session makes the engine ready
    assert post(engine, "/begin_weight_update").status_code == 200
    push(engine, new, weight_version="c")
    assert post(engine, "/end_weight_update").status_code == 200
    assert version(engine) == "c" and status(engine, "/health_generate") == 200
    assert greedy(engine) == reference_greedy(qwen3_dir_b, PROMPT, 8)[0]


def test_an_engine_that_allows_partial_updates_commits_them_as_sglang_does(qwen3_dir, qwen3_dir_b, tmp_path):
    """--rollfleet-partial-weight-updates: a session that left tensors out commits (SGLang's behaviour);
    what was sent is new, what was not keeps its value, and the answer says how many came."""
    old, new = load_file(f"{qwen3_dir}/model.safetensors"), load_file(f"{qwen3_dir_b}/model.safetensors")
    left_out, sent = "model.layers.1.mlp.down_proj.weight", "model.layers.0.mlp.down_proj.weight"
    assert not torch.equal(old[left_out], new[left_out]) and not torch.equal(old[sent], new[sent])
    with engine_server(qwen3_dir, tmp_path, extra=["--rollfleet-partial-weight-updates"]) as proc:
        assert post(proc, "/begin_weight_update").status_code == 200
        push(proc, {n: t for n, t in new.items() if n != left_out}, weight_version="b")
        ended = post(proc, "/end_weight_update")
        assert ended.status_code == 200, ended.text
        assert f"partial: {len(new) - 1} of {len(new)} tensors" in ended.json()["message"]
        assert version(proc) == "b" and status(proc, "/health_generate") == 200

        def first_rows(name):
            return torch.tensor(post(proc, "/get_weights_by_name", {"name": name, "truncate_size": 2}).json())

        assert torch.allclose(first_rows(left_out), old[left_out][:2])  # not sent: its old value
        assert torch.allclose(first_rows(sent), new[sent][:2])
        greedy(proc)  # it serves


def test_a_late_refused_call_leaves_the_engine_not_serving_and_a_disk_load_recovers(engine, qwen3_dir, qwen3_dir_b):
    new = load_file(f"{qwen3_dir_b}/model.safetensors")
    first, second = calls_of(new, 2)
    assert post(engine, "/begin_weight_update").status_code == 200
    push(engine, first, weight_version="b")
    with pytest.raises(EngineError) as err:  # a wrong shape: refused, nothing of this call applied
        push(engine, {"model.norm.weight": new["model.norm.weight"][:3]})
    assert err.value.status_code == 400
    push(engine, second)  # every tensor has arrived now, but a call of the session was refused
    ended = post(engine, "/end_weight_update")
    assert ended.status_code == 400
    message = ended.json()["message"]
    assert "call 2" in message and "/update_weights_from_tensor" in message and "model.norm.weight" in message
    assert version(engine) == "a"
    assert_not_serving(engine)
    call(engine, "update_weights_from_disk", qwen3_dir, weight_version="disk")
    assert status(engine, "/health_generate") == 200 and version(engine) == "disk"
    assert greedy(engine) == reference_greedy(qwen3_dir, PROMPT, 8)[0]


def test_a_session_that_changed_nothing_leaves_the_old_weights_served(engine, qwen3_dir):
    before = call(engine, "shard_fingerprints")
    assert post(engine, "/begin_weight_update").status_code == 200
    norm = load_file(f"{qwen3_dir}/model.safetensors")["model.norm.weight"]
    with pytest.raises(EngineError):
        push(engine, {"model.layers.0.mlp.not_a_weight": norm})
    ended = post(engine, "/end_weight_update")
    assert ended.status_code == 400 and "unchanged" in ended.json()["message"]
    assert call(engine, "shard_fingerprints") == before and version(engine) == "a"
    assert status(engine, "/health_generate") == 200 and greedy(engine)


def test_begin_twice_and_end_without_begin_are_refused(engine):
    ended = post(engine, "/end_weight_update")
    assert ended.status_code == 400
    assert ended.json() == {
        "success": False,
        "message": "no weight-update session is open; call begin_weight_update() first",
    }
    assert post(engine, "/begin_weight_update", {"selector": "target"}).status_code == 200
    again = post(engine, "/begin_weight_update")
    assert again.status_code == 400
    assert again.json() == {
        "success": False,
        "message": "a weight-update session is already open; call end_weight_update() first",
    }
    bad = post(engine, "/begin_weight_update", {"selector": "everything"})
    assert bad.status_code == 400 and "selector" in bad.json()["message"]
    assert post(engine, "/end_weight_update").status_code == 400  # nothing arrived: refused, weights unchanged
    assert status(engine, "/health_generate") == 200


def test_updates_outside_a_session_apply_their_version_per_call(engine, qwen3_dir_b):
    new = load_file(f"{qwen3_dir_b}/model.safetensors")
    first, second = calls_of(new, 2)
    push(engine, first, weight_version="half")
    assert version(engine) == "half" and status(engine, "/health_generate") == 200
    push(engine, second, weight_version="b")
    assert version(engine) == "b" and greedy(engine) == reference_greedy(qwen3_dir_b, PROMPT, 8)[0]


def test_a_session_across_a_release_is_refused(engine, qwen3_dir):
    call(engine, "release_memory_occupation", ["weights"])
    begun = post(engine, "/begin_weight_update")
    assert begun.status_code == 400 and "resume_memory_occupation" in begun.json()["message"]
    call(engine, "resume_memory_occupation", ["weights"])
    call(engine, "update_weights_from_disk", qwen3_dir, weight_version="a")
    assert post(engine, "/begin_weight_update").status_code == 200
    with pytest.raises(EngineError) as err:
        call(engine, "release_memory_occupation", ["weights"])
    assert err.value.status_code == 400 and "end_weight_update" in err.value.message
    assert post(engine, "/end_weight_update").status_code == 400
    assert status(engine, "/health_generate") == 200


def test_requests_wait_while_a_session_syncs_and_run_on_the_committed_weights(engine, qwen3_dir_b):
    new = load_file(f"{qwen3_dir_b}/model.safetensors")
    first, second = calls_of(new, 2)

    async def go():
        async with client_for(engine) as client:
            await client._call("POST", "/begin_weight_update", {})
            await client.update_weights_from_tensor(
                [serialize([b.to_payload() for b in iter_buckets(first.items(), BUCKET_BYTES)])],
                load_format="flattened_bucket",
                weight_version="b",
            )
            waiting = asyncio.create_task(client.generate(input_ids=PROMPT, sampling_params=GREEDY))
            await scheduler_stats_when(client, lambda s: s["waiting_requests"] == 1)
            assert not waiting.done()
            await client.update_weights_from_tensor(
                [serialize([b.to_payload() for b in iter_buckets(second.items(), BUCKET_BYTES)])],
                load_format="flattened_bucket",
            )
            assert (await client.get_server_info())["scheduler_stats"]["waiting_requests"] == 1
            await client._call("POST", "/end_weight_update", {})
            return await waiting

    out = run(go())
    assert out["meta_info"]["weight_version"] == "b"
    assert out["output_ids"] == reference_greedy(qwen3_dir_b, PROMPT, 8)[0]


def test_a_weight_update_waits_for_the_running_batch(engine, qwen3_dir_b):
    """The update, queued while a batch runs, is applied after its last token: every token of the
    answer is from the old version (one span). The two HTTP answers may then arrive in either order."""

    async def go():
        async with client_for(engine) as client:
            generating = asyncio.create_task(client.generate(input_ids=[1, 2, 3], sampling_params=LONG, rid="long"))
            await scheduler_stats_when(client, lambda s: s["running_requests"] == 1)
            updating = asyncio.create_task(client.update_weights_from_disk(qwen3_dir_b, weight_version="new"))
            # the update is queued on the engine thread while the batch still runs
            seen = await scheduler_stats_when(client, lambda s: s["queued_controls"] == 1 or updating.done())
            out = await generating
            await updating
            return seen, out

    seen, out = run(go())
    assert seen["queued_controls"] == 1 and seen["running_requests"] == 1, seen
    assert out["meta_info"]["weight_version"] == "a" and len(out["output_ids"]) == 400
    assert out["meta_info"]["weight_versions"] == [{"version": "a", "start": 0, "end": 400}]  # one span: not paused
    assert version(engine) == "new"
