"""No request or payload takes an engine down: bad values get 400 naming the field, a failing batch
fails only its own requests, a dead engine loop shows on /health, and /health stays fast whatever
one request asks. Against a real server process, except where the engine loop itself must fail."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import pickle
import threading
import time

import httpx
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.multiprocessing import reductions
from transformers import AutoTokenizer

from rollfleet.config import RolloutConfig
from rollfleet.engine.http.app import create_app
from rollfleet.engine.http.service import EngineService
from rollfleet.engine.model.model import ModelRunner
from rollfleet.engine.process.server_args import build_parser, check_args
from rollfleet.engine.runtime.scheduler import Scheduler
from rollfleet.engine.sequences.logprobs import LogprobAsk
from rollfleet.engine.tp.lockstep import Lockstep
from rollfleet.wire.buckets import iter_buckets
from rollfleet.wire.hf_files import read_checkpoint
from rollfleet.wire.protocol import SamplingParams
from rollfleet.wire.serialize import MAX_NESTING, safe_loads, serialize

VOCAB = 320  # rollfleet.tiny_models' qwen3
SHORT = {"max_new_tokens": 2, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(qwen3_server):
    """conftest's plain qwen3 server, shared with the other engine modules (reset for each)."""
    return qwen3_server


def post(server, route, body=None, raw: bytes | None = None, timeout=60):
    if raw is None:
        raw = json.dumps(body).encode()  # ensure_ascii: lone surrogates travel as \ud800 escapes
    return httpx.post(server.url + route, content=raw, headers={"content-type": "application/json"}, timeout=timeout)


def assert_still_serving(server):
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    ok = post(server, "/generate", {"input_ids": [1, 2], "sampling_params": SHORT})
    assert ok.status_code == 200 and len(ok.json()["output_ids"]) == 2, ok.text
    assert httpx.get(server.url + "/get_model_info", timeout=10).status_code == 200


@pytest.mark.parametrize(
    "raw, needles",
    [
        (b'{"input_ids": [1, 320]}', ["input_ids[1]=320", "vocabulary [0, 320)"]),
        (b'{"input_ids": [[1], [5, -1]]}', ["input_ids[1][1]=-1", "vocabulary"]),
        (b'{"input_ids": [1e18]}', ["input_ids[0]=1000000000000000000", "vocabulary"]),
        (b'{"input_ids": [1e20]}', ["input_ids", "1e+20"]),
        (b'{"input_ids": [1], "sampling_params": {"stop_token_ids": [7, 100000]}}', ["stop_token_ids", "100000"]),
        (b'{"input_ids": [1], "sampling_params": {"top_p": 1e-46}}', ["top_p=1e-46", "float32"]),
        (b'{"input_ids": [1], "sampling_params": {"temperature": 1e999}}', ["temperature", "finite"]),
        (b'{"input_ids": [1], "sampling_params": {"temperature": Infinity}}', ["temperature", "finite"]),
        (b'{"input_ids": [1], "sampling_params": {"temperature": NaN}}', ["temperature", "finite"]),
        (b'{"input_ids": [1], "sampling_params": {"temperature": 1e39}}', ["temperature=1e+39", "1e38"]),
        (b'{"input_ids": [1], "sampling_params": {"min_p": 1.5}}', ["min_p", "1.5"]),
        (b'{"input_ids": [1], "sampling_params": {"repetition_penalty": 0}}', ["repetition_penalty", "greater"]),
        (b'{"input_ids": [1], "sampling_params": {"sampling_seed": 18446744073709551616}}', ["sampling_seed"]),
        (b'{"text": "a\\ud800b"}', ["text", "surrogate", "UTF-8"]),
        (b'{"text": ["ok", "\\udfff"]}', ["text", "surrogate"]),
        (b'{"input_ids": [1], "rid": "\\ud800"}', ["rid", "surrogate"]),
        (b'{"input_ids": [1], "sampling_params": {"stop": ["\\ud800"]}}', ["stop", "surrogate"]),
        (b'{"input_ids": [1], "sampling_params": {"n": 10000000}}', ["n=10000000", "--max-samples-per-request"]),
        (b'{"input_ids": [[1], [2]], "sampling_params": {"n": 600}}', ["1200 samples", "at most 1024"]),
        (b'{"input_ids": [1], "sampling_params": {"stop": ' + json.dumps(["x"] * 33).encode() + b"}}", ["33", "32"]),
        (b'{"input_ids": [1], "sampling_params": {"max_new_tokens": 2, "min_new_tokens": 5}}', ["min_new_tokens=5"]),
        (
            b'{"input_ids": [1], "sampling_params": {"min_new_tokens": 2, "stop_token_ids": '
            + json.dumps(list(range(1, VOCAB))).encode()  # with EOS (0): every token
            + b"}}",
            ["stop_token_ids", f"every one of the vocabulary's {VOCAB} tokens", "min_new_tokens=2"],
        ),
        # SGLang's fields this engine cannot honour were ignored: the answer looked as if they held
        (b'{"input_ids": [1], "sampling_params": {"regex": "a+"}}', ["sampling_params.regex='a+'", "constrained"]),
        (b'{"input_ids": [[1], [2]], "sampling_params": [{}, {"json_schema": "{}"}]}', ["sampling_params[1].json"]),
        (b'{"input_ids": [1], "sampling_params": {"logit_bias": {"5": -100}}}', ["logit_bias={'5': -100}"]),
        # penalties were accepted and not applied; only their neutral values are now
        (b'{"input_ids": [1], "sampling_params": {"repetition_penalty": 1.1}}', ["repetition_penalty=1.1", "1 "]),
        (b'{"input_ids": [[1], [2]], "sampling_params": [{}, {"presence_penalty": -0.5}]}', ["[1].presence_pen"]),
    ],
)
def test_bad_generate_values_get_400_naming_the_field_and_the_engine_goes_on(server, raw, needles):
    response = post(server, "/generate", raw=raw)
    assert response.status_code == 400, response.text
    message = response.json()["message"]
    for needle in needles:
        assert needle in message, message
    assert_still_serving(server)


def test_null_fields_take_sglangs_defaults(server):
    """SGLang reads a null sampling or logprob field as its default (null max_new_tokens: up to the
    context length); here they were 400s, failing clients that send every field."""
    defaults = {"input_ids": [3, 4], "sampling_params": {"max_new_tokens": 4, "sampling_seed": 7}}
    nulls = {"temperature", "top_p", "top_k", "min_p", "n", "ignore_eos", "min_new_tokens", "repetition_penalty"}
    params = {**defaults["sampling_params"], **dict.fromkeys(nulls), "stop_token_ids": [None]}
    top = dict.fromkeys(["return_logprob", "logprob_start_len", "top_logprobs_num", "stream"])
    answers = [post(server, "/generate", body) for body in (defaults, {**defaults, **top, "sampling_params": params})]
    assert [a.status_code for a in answers] == [200, 200], answers[1].text
    assert answers[0].json()["output_ids"] == answers[1].json()["output_ids"]
    assert "output_token_logprobs" not in answers[1].json()["meta_info"]
    uncapped = {"max_new_tokens": None, "ignore_eos": True, "temperature": 0}
    answer = post(server, "/generate", {"input_ids": [5] * 500, "sampling_params": uncapped}).json()
    assert answer["meta_info"]["finish_reason"] == {"type": "length", "length": 12}  # the context is 512


def waiting_requests(server) -> int:
    return httpx.get(server.url + "/get_server_info", timeout=10).json()["scheduler_stats"]["waiting_requests"]


def test_a_rid_in_use_is_refused_so_an_abort_hits_one_request(server):
    """Two requests with one rid were both served, and /abort_request of that rid ended both; SGLang
    refuses the second (duplicate request ID), within one request too."""
    post(server, "/pause_generation", {"mode": "in_place"})
    try:
        first = {"input_ids": [1, 2], "sampling_params": SHORT, "rid": "twin"}
        sender = threading.Thread(target=lambda: first.setdefault("reply", post(server, "/generate", first)))
        sender.start()
        deadline = time.monotonic() + 30
        while waiting_requests(server) < 1:
            assert time.monotonic() < deadline, "the first request never queued"
            time.sleep(0.01)
        for body, needle in [
            ({"input_ids": [3], "rid": "twin"}, "rid 'twin' is used by an unfinished request"),
            ({"input_ids": [[3], [4]], "rid": ["x", "x"]}, "rid 'x' names two samples of this request"),
        ]:
            response = post(server, "/generate", {**body, "sampling_params": SHORT}, timeout=10)
            assert response.status_code == 400 and needle in response.json()["message"], response.text
    finally:
        post(server, "/continue_generation", {})
    sender.join()
    assert first["reply"].status_code == 200 and first["reply"].json()["meta_info"]["id"] == "twin"


def test_a_client_that_goes_away_aborts_its_request(server):
    """A /generate whose client timed out ran on to its end (here: waited forever, paused) and held its
    rid; SGLang aborts it when the client disconnects."""
    post(server, "/pause_generation", {"mode": "in_place"})
    try:
        with pytest.raises(httpx.ReadTimeout):
            post(server, "/generate", {"input_ids": [1, 2], "sampling_params": SHORT, "rid": "gone"}, timeout=1)
        deadline = time.monotonic() + 10
        while waiting_requests(server):
            assert time.monotonic() < deadline, "the request of a client that went away still waits"
            time.sleep(0.05)
    finally:
        post(server, "/continue_generation", {})
    again = post(server, "/generate", {"input_ids": [1, 2], "sampling_params": SHORT, "rid": "gone"})
    assert again.status_code == 200 and again.json()["meta_info"]["finish_reason"]["type"] == "length"


@pytest.mark.parametrize("seed", [10**14, 2**63 - 1, -(2**63)])
def test_any_seed_in_sglangs_range_samples_and_repeats(server, seed):
    params = {"max_new_tokens": 6, "temperature": 1.0, "sampling_seed": seed, "ignore_eos": True}
    first, again = (post(server, "/generate", {"input_ids": [3, 4], "sampling_params": params}) for _ in range(2))
    assert first.status_code == again.status_code == 200, first.text
    assert first.json()["output_ids"] == again.json()["output_ids"]


def test_smallest_top_p_and_largest_temperature_that_fit_float32_generate(server):
    params = {**SHORT, "top_p": 1e-38, "temperature": 1e38, "min_new_tokens": 1}
    response = post(server, "/generate", {"input_ids": [1, 2], "sampling_params": params})
    assert response.status_code == 200 and len(response.json()["output_ids"]) == 2, response.text


@pytest.mark.parametrize(
    "route, raw, needles",
    [
        ("/update_weight_version", b'{"new_version": "v\\ud800"}', ["new_version", "surrogate"]),
        ("/update_weights_from_disk", b'{"model_path": "x", "weight_version": "\\ud800"}', ["weight_version"]),
        (
            "/init_weights_update_group",
            b'{"master_address": "\\ud800", "master_port": 1, "rank_offset": 1, "world_size": 2}',
            ["master_address", "not a host name"],
        ),
        (
            "/init_weights_update_group",
            b'{"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2, "timeout_s": 1e20}',
            ["timeout_s", "less than or equal to 86400"],
        ),
        (
            "/update_weights_from_distributed",
            b'{"names": ["a"], "dtypes": ["float32"], "shapes": [[4611686018427387904, 4]]}',
            ["shapes[0]", "real shape"],
        ),
        ("/abort_request", b'{"rid": "\\ud800"}', ["rid", "surrogate"]),
    ],
)
def test_unencodable_strings_and_absurd_numbers_are_refused_at_the_door(server, route, raw, needles):
    response = post(server, route, raw=raw)
    assert response.status_code == 400, response.text
    for needle in needles:
        assert needle in response.json()["message"], response.json()
    assert_still_serving(server)
    assert httpx.get(server.url + "/get_model_info", timeout=10).json()["weight_version"] == "default"


GROUP = {"master_port": 1, "rank_offset": 1, "world_size": 2, "backend": "gloo", "timeout_s": 1}
RFORK = {"ports": "29600", "group_rank": 0, "world_size": 2, "backend": "gloo"}


@pytest.mark.parametrize("host", ["", "x?rank=3", "a/b", "::1", "a b"])
@pytest.mark.parametrize(
    "route, body, field",
    [
        ("/init_weights_update_group", GROUP, "master_address"),
        ("/init_weights_send_group_for_remote_instance", RFORK, "master_address"),
        ("/send_weights_to_remote_instance", {"ports": "29600"}, "master_address"),
        ("/rollfleet/load_from_remote_instance", {"seed_port": 1, "ports": "29600", "timeout_s": 1}, "seed_host"),
    ],
)
def test_a_host_that_is_no_host_is_refused_before_any_join(server, route, body, field, host):
    """ "" and "x?rank=3" failed torch's rendezvous asserts (500; on tp > 1 every rank raised outside
    the refusal path and the engine stopped)."""
    response = post(server, route, {**body, field: host}, timeout=30)
    assert response.status_code == 400, response.text
    assert f"{field}: Value error, {host!r} is not a host name" in response.json()["message"], response.text
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


@pytest.mark.parametrize(
    "method, route, raw, status, needles",
    [
        ("POST", "/generate", b'{"input_ids": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, ["JSON object"]),
        ("POST", "/generate", b"\xff\xfe{", 400, ["error parsing the body", "UTF-8"]),
        ("POST", "/generate", b'{"input_ids": [1,', 400, ["not valid JSON (at character 17", "one JSON object"]),
        ("GET", "/generate", b"", 405, ["GET /generate", "use POST"]),
        ("POST", "/no_such_route", b"{}", 404, ["/no_such_route", "no such route"]),
    ],
)
def test_bodies_fastapi_cannot_parse_get_this_servers_error_shape(server, method, route, raw, status, needles):
    """These answered FastAPI's {"detail": ...}, naming neither the request nor the fix."""
    json_body = {"content-type": "application/json"}
    response = httpx.request(method, server.url + route, content=raw, headers=json_body, timeout=30)
    assert response.status_code == status and set(response.json()) == {"success", "message"}, response.text
    assert all(needle in response.json()["message"] for needle in needles), response.text
    openai = httpx.post(server.url + "/v1/completions", content=b"\xff", headers=json_body, timeout=30).json()
    assert openai["object"] == "error" and "POST /v1/completions" in openai["message"], openai


# ---- weight payloads ------------------------------------------------------------------------------
class _EmptyStorage:
    def __reduce__(self):
        return reductions.rebuild_storage_empty, (torch.UntypedStorage,)


class _TypedEmpty:
    def __reduce__(self):
        return reductions.rebuild_typed_storage, (_EmptyStorage(), torch.float32)


class _GrownTensor:
    """Only allowlisted functions: an empty storage that `set_` (inside rebuild_tensor) would grow."""

    def __reduce__(self):
        return reductions.rebuild_tensor, (torch.Tensor, _TypedEmpty(), (0, (64,), (1,), False))


class _FreshStorage:
    def __reduce__(self):
        return torch.UntypedStorage, (256,)


def _deep_bucket_pickle(depth: int) -> bytes:
    """{"flattened_tensor": None, "metadata": [[[...]]]} nested `depth` deep, written as opcodes
    (pickle.dumps itself would recurse)."""
    key = b"metadata"
    nested = pickle.EMPTY_LIST * depth + pickle.APPEND * (depth - 1)
    flat = b"X" + len(b"flattened_tensor").to_bytes(4, "little") + b"flattened_tensor" + pickle.NONE
    meta = b"X" + len(key).to_bytes(4, "little") + key + nested
    return pickle.PROTO + b"\x02" + pickle.EMPTY_DICT + flat + pickle.SETITEM + meta + pickle.SETITEM + pickle.STOP


def _bucket_of_norm(**record) -> dict:
    """A bucket of model.norm.weight (64 floats) with some metadata field replaced."""
    meta = {"name": "model.norm.weight", "shape": (64,), "dtype": torch.float32, "start_idx": 0, "end_idx": 64}
    return {"flattened_tensor": torch.full((64,), 3.0), "metadata": [{**meta, "numel": 64, **record}]}


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@pytest.mark.parametrize(
    "payload, load_format, needles",
    [
        (_b64(pickle.dumps([("model.norm.weight", _GrownTensor())])), None, ["needs 256 bytes", "holds 0"]),
        (_b64(pickle.dumps([("model.norm.weight", _FreshStorage())])), None, ["calling", "UntypedStorage"]),
        (_b64(_deep_bucket_pickle(100_000)), "flattened_bucket", [f"nest more than {MAX_NESTING} deep"]),
        (serialize(_bucket_of_norm(shape=(-8, -8))), "flattened_bucket", ["shape (-8, -8) has a negative size"]),
        (serialize(_bucket_of_norm(start_idx=0.5)), "flattened_bucket", ["model.norm.weight", "malformed", "float"]),
    ],
    ids=["storage-grown-by-set_", "storage-class-called", "100000-deep-metadata", "negative-dims", "float-offset"],
)
def test_payloads_torch_never_sends_are_refused_and_change_nothing(server, payload, load_format, needles):
    before = post(server, "/get_weights_by_name", {"name": "model.norm.weight", "truncate_size": 8}).json()
    body = {"serialized_named_tensors": [payload], "load_format": load_format}
    response = post(server, "/update_weights_from_tensor", body)
    assert response.status_code == 400, response.text
    for needle in needles:
        assert needle in response.json()["message"], response.json()
    assert post(server, "/get_weights_by_name", {"name": "model.norm.weight", "truncate_size": 8}).json() == before
    assert_still_serving(server)


def test_real_payloads_still_load_and_a_regular_checkpoint_still_reads(server, qwen3_dir, qwen3_dir_b):
    """The checks refuse only what torch never sends: pairs of views with offsets and buckets load."""
    other = read_checkpoint(qwen3_dir_b)
    norm = {"name": "model.norm.weight", "truncate_size": 4}
    buckets = [bucket.to_payload() for bucket in iter_buckets(sorted(other.items()), 64 * 1024)]
    for payload, load_format in [(buckets, "flattened_bucket"), (sorted(other.items()), None)]:
        body = {"serialized_named_tensors": [serialize(payload)], "load_format": load_format}
        assert post(server, "/update_weights_from_tensor", body).status_code == 200
        got = post(server, "/get_weights_by_name", norm).json()
        assert got == pytest.approx(other["model.norm.weight"][:4].tolist())
    assert post(server, "/update_weights_from_disk", {"model_path": qwen3_dir}).status_code == 200
    got = post(server, "/get_weights_by_name", norm).json()
    assert got == pytest.approx(read_checkpoint(qwen3_dir)["model.norm.weight"][:4].tolist())


def test_shared_references_are_walked_once_and_cycles_refused():
    node: list = []
    for _ in range(MAX_NESTING - 2):  # 2**30 paths through 30 distinct lists: walked in no time
        node = [node, node]
    assert len(safe_loads(pickle.dumps(node))) == 2
    loop: list = []
    loop.append(loop)
    with pytest.raises(pickle.UnpicklingError, match="contains itself"):
        safe_loads(pickle.dumps(loop))


# ---- checkpoints on disk -------------------------------------------------------------------------
def test_a_fifo_named_safetensors_is_refused_without_freezing(server, tmp_path):
    os.mkfifo(tmp_path / "model.safetensors")
    response = post(server, "/update_weights_from_disk", {"model_path": str(tmp_path)}, timeout=30)
    assert response.status_code == 400, response.text
    assert "model.safetensors" in response.json()["message"] and "FIFO" in response.json()["message"]
    assert_still_serving(server)


@pytest.mark.parametrize(
    "path, needle",
    [
        ("m" * 400, "... (400 characters) cannot be read (File name too long)"),  # a name past 255 bytes
        ("d/" * 2100, "... (4200 characters) cannot be read (File name too long)"),  # a path past PATH_MAX
        ("a\u0000b", "is not a directory"),  # a NUL byte: no such path
    ],
)
def test_a_model_path_the_filesystem_refuses_gets_400_naming_it(server, path, needle):
    """A name too long (ENAMETOOLONG) raised out of the route as a bare 500."""
    response = post(server, "/update_weights_from_disk", {"model_path": path}, timeout=30)
    assert response.status_code == 400, response.text
    message = response.json()["message"]
    assert message.startswith("model_path=") and needle in message and "give a HF model directory" in message
    assert_still_serving(server)


# ---- released weights ----------------------------------------------------------------------------
RELEASED = "weights are released: call /resume_memory_occupation with tags ['weights'] first"
WEIGHT_READS = [
    ("POST", "/get_weights_by_name", {"name": "model.norm.weight", "truncate_size": 4}),
    ("GET", "/rollfleet/shard_fingerprints", None),
    ("POST", "/rollfleet/weights_fingerprint", {"names": ["model.norm.weight"]}),
    ("POST", "/rollfleet/weights_fingerprint", {"names": None}),
]


def read_weights(server, method, route, body):
    return httpx.request(method, server.url + route, json=body, timeout=60)


def test_weight_reads_after_a_release_are_refused_and_touch_no_freed_memory(server, qwen3_dir):
    """Reads of released weights once crashed the server (SIGSEGV on the fingerprints) or gave 500."""
    before = [read_weights(server, *read).json() for read in WEIGHT_READS]
    assert post(server, "/release_memory_occupation", {"tags": ["weights"]}).status_code == 200
    for read in WEIGHT_READS:
        refused = read_weights(server, *read)
        assert refused.status_code == 400 and refused.json()["message"] == RELEASED, (read, refused.text[:300])
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200, read
    assert post(server, "/resume_memory_occupation", {"tags": ["weights"]}).status_code == 200
    assert post(server, "/update_weights_from_disk", {"model_path": qwen3_dir}).status_code == 200
    after = [read_weights(server, *read) for read in WEIGHT_READS]
    assert [reply.status_code for reply in after] == [200] * len(WEIGHT_READS)
    assert [reply.json() for reply in after] == before
    assert_still_serving(server)


def strict_json(text: str):
    """JSON as the standard has it: Python's parser would take NaN and Infinity too."""

    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_nan_weights_answer_null_where_values_are_not_finite(server, qwen3_dir):
    """Weights holding NaN (a diverged trainer's push, accepted as SGLang accepts it) made every answer
    that carries their values a 500, or a stream of non-JSON `NaN`; SGLang's answers (orjson) write null."""
    nan = serialize([("model.norm.weight", torch.full((64,), float("nan")))])
    assert post(server, "/update_weights_from_tensor", {"serialized_named_tensors": [nan]}).status_code == 200
    try:
        weights = post(server, "/get_weights_by_name", {"name": "model.norm.weight", "truncate_size": 3})
        assert weights.status_code == 200 and strict_json(weights.text) == [None] * 3, weights.text
        greedy = {"input_ids": [1, 2], "sampling_params": {**SHORT, "temperature": 0}, "return_logprob": True}
        answer = post(server, "/generate", greedy)
        assert answer.status_code == 200, answer.text
        assert [v for v, _, _ in strict_json(answer.text)["meta_info"]["output_token_logprobs"]] == [None, None]
        chunks = post(server, "/generate", {**greedy, "stream": True}).text.split("\n\n")
        assert chunks[-2:] == ["data: [DONE]", ""]
        assert strict_json(chunks[-3].removeprefix("data: "))["meta_info"]["output_token_logprobs"][-1][0] is None
        body = {"prompt": [1, 2], "max_tokens": 2, "temperature": 0, "ignore_eos": True, "logprobs": 1}
        completion = post(server, "/v1/completions", body)
        assert completion.status_code == 200, completion.text
        assert strict_json(completion.text)["choices"][0]["logprobs"]["token_logprobs"] == [None, None]
    finally:
        assert post(server, "/update_weights_from_disk", {"model_path": qwen3_dir}).status_code == 200
    assert_still_serving(server)


# ---- size and latency ----------------------------------------------------------------------------
def test_a_body_over_the_limit_gets_413(server):
    raw = b'{"input_ids": [' + b"1," * (4 * 2**20) + b"1]}"  # 8 MiB + a little: the default limit
    response = post(server, "/generate", raw=raw)
    assert response.status_code == 413 and "--max-request-bytes" in response.json()["message"]

    def chunks():  # no Content-Length: counted as it arrives
        yield raw[: 2**20]
        yield raw[2**20 :]

    chunked = httpx.post(server.url + "/generate", content=chunks(), timeout=60)
    assert chunked.status_code == 413
    assert_still_serving(server)


@pytest.mark.parametrize(
    "body, answer",
    [
        ({"input_ids": [5] * 400, "sampling_params": {**SHORT, "max_new_tokens": 8, "n": 1024}}, 200),
        ({"input_ids": [[7] * 500] * 1000, "sampling_params": SHORT}, 200),  # 2 MB of prompts
        ({"text": "the quick brown fox " * 5000}, 400),  # tokenized (65001 tokens), then refused
    ],
    ids=["1024-samples", "1000-long-prompts", "100-kB-text"],
)
def test_health_stays_fast_while_a_large_allowed_request_runs(server, body, answer):
    outcome = {}
    sender = threading.Thread(target=lambda: outcome.setdefault("reply", post(server, "/generate", body, timeout=600)))
    sender.start()
    slowest = 0.0
    with httpx.Client(timeout=30) as client:
        while sender.is_alive():
            start = time.perf_counter()
            assert client.get(server.url + "/health").status_code == 200
            slowest = max(slowest, time.perf_counter() - start)
            time.sleep(0.05)
    sender.join()
    assert outcome["reply"].status_code == answer, outcome["reply"].text[:300]
    # the claim is the fleet's: no probe of a busy, healthy engine fails (a probe slower than
    # rollout.probe_timeout_s counts as failed), so the request never costs the engine its place
    timeout_s = RolloutConfig.model_fields["probe_timeout_s"].default
    assert slowest < timeout_s, f"/health took {slowest:.2f} s while the request ran: a probe would fail"


# ---- the engine loop -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine_parts(qwen3_dir):
    runner = ModelRunner(qwen3_dir)
    return runner, AutoTokenizer.from_pretrained(qwen3_dir)


def _scheduler(engine_parts, **kwargs) -> Scheduler:
    runner, tokenizer = engine_parts
    return Scheduler(
        Lockstep(runner, None),
        tokenizer,
        eos_token_ids=set(),
        context_length=512,
        max_running_requests=8,
        weight_version="default",
        vocab_size=VOCAB,
        **kwargs,
    )


def _app(engine_parts, qwen3_dir, scheduler: Scheduler):
    """The server's app, as the server builds it, over `scheduler`."""
    parser = build_parser()
    args = parser.parse_args(["--model-path", qwen3_dir, "--device", "cpu"])
    check_args(parser, args)
    runner, tokenizer = engine_parts
    return create_app(EngineService(args, runner, Lockstep(runner, None), scheduler, tokenizer))


def _result(seq):
    return seq.future.result(timeout=120)


def test_a_failing_batch_fails_only_its_own_requests(engine_parts):
    """Requests the route would refuse, submitted straight to the scheduler: the model and the
    sampler raise for real, that batch finishes as aborted with the reason, the next one runs."""
    scheduler = _scheduler(engine_parts)
    scheduler.start()
    try:
        (outside,) = scheduler.submit([1, VOCAB + 5], SamplingParams(**SHORT), rid="bad", return_logprob=False)
        reason = _result(outside)["meta_info"]["finish_reason"]
        assert reason["type"] == "abort" and "the engine failed this batch" in reason["message"], reason
        outside_ask = LogprobAsk(token_ids=(VOCAB + 5,))  # the sampler's gather raises
        (unsampleable,) = scheduler.submit(
            [1, 2], SamplingParams(**SHORT), rid="bad-id", return_logprob=True, ask=outside_ask
        )
        assert _result(unsampleable)["meta_info"]["finish_reason"]["type"] == "abort"
        (good,) = scheduler.submit([1, 2], SamplingParams(**SHORT), rid="good", return_logprob=False)
        assert _result(good)["meta_info"]["finish_reason"] == {"type": "length", "length": 2}
        assert scheduler.dead_reason is None
    finally:
        scheduler.stop()


def test_an_answered_request_is_no_longer_unfinished(engine_parts):
    """A client that has its answer may flush the cache or release memory at once: when a sample's
    answer resolves, the engine counts nothing of its request as unfinished (it used to answer first
    and leave the running set just after: a client fast enough got 400 "requests are running")."""
    scheduler = _scheduler(engine_parts)
    seen = []
    scheduler.start()
    try:
        for params, abort in ((SamplingParams(**SHORT, n=3), False), (SamplingParams(max_new_tokens=64), True)):
            seqs = scheduler.submit([1, 2, 3], params, rid="r", return_logprob=False)
            for seq in seqs:  # called on the engine thread, as the answer resolves
                seq.future.add_done_callback(lambda _f, s=seq: seen.append(s.rid in scheduler.unfinished_rids()))
            if abort:
                scheduler.abort("r")
            assert all(_result(seq)["meta_info"]["finish_reason"] for seq in seqs)
        assert seen == [False] * 4 and scheduler.num_unfinished == 0
    finally:
        scheduler.stop()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the loop re-raises, on purpose
def test_health_is_503_with_the_reason_when_the_engine_loop_has_died(engine_parts, qwen3_dir):
    def no_device():
        raise RuntimeError("no device for the engine thread")

    scheduler = _scheduler(engine_parts, thread_setup=no_device)
    scheduler.start()
    scheduler.stop()
    app = _app(engine_parts, qwen3_dir, scheduler)

    async def probe():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://engine") as client:
            health = await client.get("/health")
            update = await client.post("/update_weight_version", json={"new_version": "v2"})
            return health, update

    health, update = asyncio.run(probe())
    assert health.status_code == 503 and "no device for the engine thread" in health.json()["message"]
    assert update.status_code == 503 and "the engine loop has stopped" in update.json()["message"]


def test_a_routes_own_failure_answers_a_json_500_not_a_dropped_connection(engine_parts, qwen3_dir):
    """Bad input is a 4xx before a route fails; a route's bug (one was a name too long) dropped the
    connection with no answer. Routes added here raise, in the server's app as built."""
    app = _app(engine_parts, qwen3_dir, _scheduler(engine_parts))

    def boom():
        raise OSError(36, "File name too long")

    for path in ("/rollfleet/boom", "/v1/boom"):
        app.add_api_route(path, boom, methods=["POST"])

    async def ask():
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)  # uvicorn logs it and goes on
        async with httpx.AsyncClient(transport=transport, base_url="http://engine") as client:
            return await client.post("/rollfleet/boom"), await client.post("/v1/boom")

    ours, openai = asyncio.run(ask())
    assert ours.status_code == 500 and ours.json()["success"] is False
    said = ours.json()["message"]
    assert said.startswith("POST /rollfleet/boom: internal error (OSError: [Errno 36] File name too long)"), said
    assert openai.status_code == 500 and openai.json()["type"] == "InternalServerError"  # OpenAI's error shape
    assert openai.json()["message"].startswith("POST /v1/boom: internal error")


# ---- fuzzing /generate ---------------------------------------------------------------------------
_texts = st.text(st.one_of(st.characters(), st.integers(0xD800, 0xDFFF).map(chr)), max_size=40)  # lone surrogates too
_numbers = st.one_of(
    st.integers(-3, 8),
    st.integers(),
    st.sampled_from([VOCAB - 1, VOCAB, 2**63, 2**64, -(2**63) - 1, 10**30]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([1e-46, 1e-38, 1e38, 1e39, 5e-324, -0.0, 1e20]),
)
_scalars = st.one_of(st.none(), st.booleans(), _numbers, _texts)
_token_lists = st.lists(st.one_of(st.integers(0, VOCAB - 1), _numbers), max_size=6)
_sampling = st.dictionaries(
    st.sampled_from(
        [
            "max_new_tokens",
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "n",
            "stop",
            "stop_token_ids",
            "ignore_eos",
            "skip_special_tokens",
            "sampling_seed",
            "min_new_tokens",
            "frequency_penalty",
            "presence_penalty",
            "repetition_penalty",
            "no_stop_trim",
        ]
    ),  # fmt: skip
    st.one_of(_scalars, st.lists(_scalars, max_size=3), _token_lists),
    max_size=6,
).map(lambda params: {**params, "max_new_tokens": params.get("max_new_tokens", 2)})
_wild_bodies = st.fixed_dictionaries(
    {},
    optional={
        "text": st.one_of(_texts, st.lists(_texts, max_size=3), _scalars),
        "input_ids": st.one_of(_token_lists, st.lists(_token_lists, max_size=3), _scalars),
        "sampling_params": st.one_of(_sampling, st.lists(_sampling, max_size=3), _scalars),
        "return_logprob": _scalars,
        "logprob_start_len": _scalars,
        "top_logprobs_num": _scalars,
        "token_ids_logprob": st.one_of(_token_lists, _scalars),
        "return_text_in_logprobs": _scalars,
        "stream": _scalars,
        "rid": st.one_of(_texts, st.lists(_texts, max_size=3), _scalars),
        "lora_path": st.one_of(_texts, st.lists(st.one_of(st.none(), _texts), max_size=3), _scalars),
    },
)
# one well-formed prompt field and a few sampling fields: such bodies reach the engine, so a value
# that only breaks the tokenizer, the sampler or the response shows up
_prompt = st.one_of(
    st.fixed_dictionaries(
        {"text": st.one_of(_texts.filter(bool), st.lists(_texts.filter(bool), min_size=1, max_size=3))}
    ),
    st.fixed_dictionaries({"input_ids": st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6)}),
    st.fixed_dictionaries({"input_ids": st.lists(_token_lists.filter(bool), min_size=1, max_size=3)}),
)
_near_valid_bodies = st.tuples(
    _prompt,
    st.fixed_dictionaries(
        {"sampling_params": _sampling},
        optional={
            "rid": _texts,
            "return_logprob": st.booleans(),
            "lora_path": st.one_of(st.none(), _texts),
            "logprob_start_len": st.integers(-1, 4),
            "top_logprobs_num": st.integers(0, 4),
            "token_ids_logprob": _token_lists,
            "return_text_in_logprobs": st.booleans(),
            "stream": st.booleans(),
        },
    ),
).map(lambda parts: {**parts[0], **parts[1]})
_bodies = st.one_of(_near_valid_bodies, _near_valid_bodies, _wild_bodies)


_FUZZ_STATUSES: list[int] = []


def _small(value) -> bool:
    """Valid but slow: a max_new_tokens past a few tokens runs to the context length (512)."""
    params = value.get("sampling_params")
    items = params if isinstance(params, list) else [params]
    limit = [p.get("max_new_tokens") for p in items if isinstance(p, dict)]
    return all(m is not None and (not isinstance(m, (int, float)) or m <= 8) for m in limit)  # None: uncapped


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=_bodies.filter(_small))
def test_fuzzed_generate_bodies_never_get_a_500(server, body):
    raw = json.dumps(body).encode()  # NaN / Infinity literals and \ud800 escapes, as a hostile client may send
    response = post(server, "/generate", raw=raw)
    _FUZZ_STATUSES.append(response.status_code)
    assert response.status_code in (200, 400), (body, response.status_code, response.text[:500])
    if response.status_code == 400:
        assert response.json()["message"]


def test_the_server_still_generates_after_the_fuzzing(server):
    if _FUZZ_STATUSES:  # the fuzzing ran first (file order): it reached the engine, not only the validators
        assert 200 in _FUZZ_STATUSES and 400 in _FUZZ_STATUSES, sorted(set(_FUZZ_STATUSES))
    assert_still_serving(server)
