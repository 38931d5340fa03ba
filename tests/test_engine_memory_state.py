"""Release and resume on real servers at tp 1 and tp 2: SGLang 0.5.23's bookkeeping (a second release
of a tag succeeds and frees nothing twice; a resume of a tag not released, or of another tag than the
one released, is a 400 naming the tag and its state, nothing changed), and
--enable-weights-cpu-backup's cycle (the weights come back from the host copy bit-exact and the
engine serves without a push, also after a refused disk update while released); without the flag
released weights stay unloaded until a push."""

from __future__ import annotations

import httpx
import pytest
from conftest import call, engine_servers

from rollfleet.wire.client import EngineError

PROMPT = [5, 17, 42, 99, 7]
GREEDY = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}


@pytest.fixture(scope="module")
def backup_servers(qwen3_dir, tmp_path_factory):
    extra = ["--enable-weights-cpu-backup"]
    plan = {"tp1": (qwen3_dir, {"extra": extra}), "tp2": (qwen3_dir, {"tp_size": 2, "extra": extra})}
    with engine_servers(plan, tmp_path_factory.mktemp("backup-servers")) as procs:
        yield procs


@pytest.fixture(params=["tp1", "tp2"])
def server(request, backup_servers):
    return backup_servers[request.param]


def post(server, route: str, body: dict | None = None) -> httpx.Response:
    return httpx.post(server.url + route, json=body, timeout=60)


def refused(server, route: str, tags: list[str] | None) -> str:
    answer = post(server, route, {"tags": tags})
    assert answer.status_code == 400, answer.text
    return answer.json()["message"]


def greedy(server) -> list[int]:
    return call(server, "generate", input_ids=PROMPT, sampling_params=GREEDY)["output_ids"]


def memory(server) -> list[dict]:
    return call(server, "memory")


def kv_epoch(server) -> int:
    """The KV pool's count of releases and resumes (kv/pool.py)."""
    return call(server, "get_server_info")["rollfleet_kv_cache"]["epoch"]


def released(server) -> list[str]:
    return call(server, "get_server_info")["rollfleet_released_memory"]


def test_a_release_adds_to_the_released_tags_and_frees_nothing_twice(server):
    """SGLang 0.5.23's record is a set: a release of tags already released succeeds (XTuner releases all
    tags while `cuda_graph` is still released); here it frees only what is still held."""
    output, resident = greedy(server), [rank["weight_bytes"] for rank in memory(server)]
    epoch = kv_epoch(server)
    call(server, "release_memory_occupation", ["kv_cache"])
    call(server, "release_memory_occupation", ["kv_cache"])
    assert kv_epoch(server) == epoch + 1 and released(server) == ["kv_cache"]  # the pool released once
    assert [rank["weight_bytes"] for rank in memory(server)] == resident
    # a generate meanwhile is refused before any rank steps on the freed pool (at tp 2 a step that
    # failed on every rank lost the follower), naming the fix
    answer = post(server, "/generate", {"input_ids": PROMPT, "sampling_params": GREEDY})
    assert answer.status_code == 503 and "the KV cache is released" in answer.json()["message"], answer.text
    assert httpx.get(server.url + "/health_generate", timeout=60).status_code == 503
    call(server, "release_memory_occupation", None)  # all tags: the weights go, the KV cache is gone already
    assert kv_epoch(server) == epoch + 1 and released(server) == ["cuda_graph", "kv_cache", "weights"]
    assert [rank["weight_bytes"] for rank in memory(server)] == [0] * len(resident)
    call(server, "resume_memory_occupation", None)
    assert kv_epoch(server) == epoch + 2 and released(server) == []
    assert greedy(server) == output  # the host copy of the first release of the weights came back


def test_a_resume_of_a_tag_not_released_is_refused_naming_it_and_changes_nothing(server):
    """SGLang 0.5.23's scheduler raises there (`set.remove`), which ends its server; here a 400 names
    the tag and what is released, and nothing is resumed, not even the call's other tags."""
    message = refused(server, "/resume_memory_occupation", ["kv_cache"])
    assert "tag 'kv_cache' is not currently released" in message and "nothing is released now" in message
    call(server, "release_memory_occupation", ["kv_cache"])
    message = refused(server, "/resume_memory_occupation", ["weights"])
    assert "tag 'weights' is not currently released" in message and "released now: ['kv_cache']" in message
    epoch = kv_epoch(server)
    message = refused(server, "/resume_memory_occupation", None)  # all tags: kv_cache and two not released
    assert "tags ['weights', 'cuda_graph'] are not currently released" in message
    assert kv_epoch(server) == epoch and released(server) == ["kv_cache"]  # the KV cache was not resumed
    call(server, "resume_memory_occupation", ["kv_cache"])
    assert "not currently released" in refused(server, "/resume_memory_occupation", ["kv_cache"])
    call(server, "release_memory_occupation", None)
    call(server, "resume_memory_occupation", ["weights"])
    assert "tag 'weights' is not currently released" in refused(server, "/resume_memory_occupation", ["weights"])
    call(server, "resume_memory_occupation", ["kv_cache", "cuda_graph"])
    assert "not currently released" in refused(server, "/resume_memory_occupation", None)
    assert httpx.get(server.url + "/health_generate", timeout=60).status_code == 200


def test_cpu_backup_restores_the_weights_bit_exact_and_serves_without_a_push(server):
    before, output, version = call(server, "shard_fingerprints"), greedy(server), call(server, "get_model_info")
    resident = [rank["weight_bytes"] for rank in memory(server)]
    call(server, "release_memory_occupation", None)
    released = memory(server)
    assert [rank["weight_bytes"] for rank in released] == [0] * len(resident)
    assert [rank["host_copy_bytes"] for rank in released] == resident  # a host copy per rank, of every byte
    assert not any(rank["host_copy_pinned"] for rank in released)  # pinned only beside a GPU
    assert httpx.get(server.url + "/ready", timeout=60).status_code == 503
    # a second release is accepted and keeps the first one's copy
    call(server, "release_memory_occupation", ["weights"])
    assert [rank["host_copy_bytes"] for rank in memory(server)] == resident
    call(server, "resume_memory_occupation", None)
    assert [(rank["weight_bytes"], rank["host_copy_bytes"]) for rank in memory(server)] == [(b, 0) for b in resident]
    assert call(server, "shard_fingerprints") == before
    assert greedy(server) == output
    assert call(server, "get_model_info")["weight_version"] == version["weight_version"]


def test_a_refused_disk_update_while_released_keeps_the_host_copy(server):
    """It dropped the copy: the resume after it served nothing (503, weights not loaded) until a push."""
    before, output = call(server, "shard_fingerprints"), greedy(server)
    call(server, "release_memory_occupation", ["weights"])
    with pytest.raises(EngineError) as err:
        call(server, "update_weights_from_disk", "/nonexistent")
    assert err.value.status_code == 400
    assert all(rank["weight_bytes"] == 0 and rank["host_copy_bytes"] > 0 for rank in memory(server))
    call(server, "resume_memory_occupation", ["weights"])
    assert call(server, "shard_fingerprints") == before
    assert greedy(server) == output


def test_get_weight_version_answers_as_slime_reads_it(server):
    call(server, "update_weight_version", "v-slime")
    try:
        answer = httpx.get(server.url + "/get_weight_version", timeout=60)
        assert answer.status_code == 200 and answer.json() == {"weight_version": "v-slime"}
    finally:
        call(server, "update_weight_version", "default")


def test_without_the_flag_released_weights_wait_for_a_push(qwen3_server, qwen3_dir):
    call(qwen3_server, "release_memory_occupation", ["weights", "kv_cache"])
    assert memory(qwen3_server)[0]["host_copy_bytes"] == 0
    call(qwen3_server, "resume_memory_occupation", ["weights", "kv_cache"])
    with pytest.raises(EngineError) as err:
        greedy(qwen3_server)
    assert err.value.status_code == 503 and "weights are not loaded" in err.value.message
    call(qwen3_server, "update_weights_from_disk", qwen3_dir)
    assert len(greedy(qwen3_server)) == GREEDY["max_new_tokens"]


def test_a_resume_the_device_cannot_back_is_refused_before_it_maps_anything():
    """The GPU's check, as arithmetic (its figures come from the device there): the saver's map needs
    free device memory (a failed map ends the process); torch's allocations may use cached blocks."""
    from rollfleet.engine.model.model import resume_refusal

    gib = 1 << 30
    assert resume_refusal(["kv_cache"], "cuda:0", mapped=40 * gib, allocated=0, free=41 * gib, cached=0) is None
    assert resume_refusal(["weights"], "cuda:0", mapped=0, allocated=4 * gib, free=1 * gib, cached=3 * gib) is None
    why = resume_refusal(
        ["kv_cache", "weights"], "cuda:0", mapped=40 * gib, allocated=4 * gib, free=38 * gib, cached=9 * gib
    )
    assert why is not None
    from rollfleet.wire.errors import RESUME_REFUSED

    assert RESUME_REFUSED in why  # how the fleet tells this refusal from others (fleet/colocation.py)
    for part in ["['kv_cache', 'weights']", "refused, nothing changed", "44.00 GiB", "cuda:0", "38.00 GiB is free"]:
        assert part in why, why
    # the cache does not back the saver's map
    assert resume_refusal(["kv_cache"], "cuda:0", mapped=40 * gib, allocated=0, free=39 * gib, cached=8 * gib)
    assert resume_refusal(["weights"], "cuda:0", mapped=0, allocated=5 * gib, free=1 * gib, cached=3 * gib)
