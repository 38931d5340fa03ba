"""API key on every route but SGLang's open health paths; with --admin-api-key too, SGLang's split (the
admin routes take only the admin key, the others only the API key); loopback binding, and bad requests
answered with 400 while serving on."""

from __future__ import annotations

import socket

import httpx
import pytest
from conftest import engine_server, run

from rollfleet.engine.process.server import main as server_main
from rollfleet.wire.auth import is_admin_route
from rollfleet.wire.client import EngineClient

KEY = "s3cret"
ADMIN_KEY = "adm1n"
ROUTES = [
    ("POST", "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 1}}),
    ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 1}),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ("GET", "/v1/models", None),
    ("GET", "/v1/loads", None),
    ("GET", "/get_model_info", None),
    ("GET", "/model_info", None),
    ("GET", "/get_server_info", None),
    ("GET", "/get_weight_version", None),
    ("GET", "/server_info", None),
    ("POST", "/flush_cache", None),
    ("POST", "/update_weights_from_disk", {"model_path": "/nonexistent"}),
    ("POST", "/update_weight_version", {"new_version": "x"}),
    ("POST", "/update_weights_from_tensor", {"serialized_named_tensors": ["x"]}),
    (
        "POST",
        "/init_weights_update_group",
        {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2},
    ),
    ("POST", "/update_weights_from_distributed", {"names": [], "dtypes": [], "shapes": []}),
    ("POST", "/destroy_weights_update_group", {}),
    ("POST", "/begin_weight_update", {"selector": "all"}),
    ("POST", "/end_weight_update", {}),
    ("POST", "/get_weights_by_name", {"name": "model.norm.weight"}),
    ("GET", "/rollfleet/shard_fingerprints", None),
    ("GET", "/rollfleet/memory", None),
    ("POST", "/rollfleet/step", {"steps": 1}),
    ("POST", "/rollfleet/weights_fingerprint", {"names": ["model.norm.weight"]}),
    ("POST", "/release_memory_occupation", {"tags": ["kv_cache"]}),
    ("POST", "/resume_memory_occupation", {"tags": ["kv_cache"]}),
    ("POST", "/abort_request", {"abort_all": True}),
    ("POST", "/pause_generation", {"mode": "in_place"}),
    ("POST", "/continue_generation", {}),
    ("POST", "/load_lora_adapter", {"lora_name": "x", "lora_path": "/nonexistent"}),
    (
        "POST",
        "/load_lora_adapter_from_tensors",
        {"lora_name": "x", "config_dict": {}, "serialized_named_tensors": ["x"]},
    ),
    ("POST", "/unload_lora_adapter", {"lora_name": "x"}),
    (
        "POST",
        "/init_weights_send_group_for_remote_instance",
        {"master_address": "127.0.0.1", "ports": "1", "group_rank": 0, "world_size": 2},
    ),
    ("POST", "/send_weights_to_remote_instance", {"master_address": "127.0.0.1", "ports": "1"}),
    ("POST", "/rollfleet/load_from_remote_instance", {"seed_host": "127.0.0.1", "seed_port": 1, "ports": "1"}),
    ("GET", "/rollfleet/weight_layout", None),
]

OPEN_ROUTES = {"/health", "/health_generate", "/ready"}


@pytest.fixture(scope="module")
def server(qwen3_dir, tmp_path_factory):
    with engine_server(qwen3_dir, tmp_path_factory.mktemp("logs"), api_key=KEY) as proc:
        yield proc


@pytest.fixture(scope="module")
def admin_server(qwen3_dir, tmp_path_factory):
    extra = ["--admin-api-key", ADMIN_KEY]
    with engine_server(qwen3_dir, tmp_path_factory.mktemp("logs"), api_key=KEY, extra=extra) as proc:
        yield proc


def send(server, method, route, body=None, key=KEY, raw=None):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if raw is not None:
        return httpx.request(
            method, server.url + route, content=raw, timeout=30, headers={**headers, "content-type": "application/json"}
        )
    return httpx.request(method, server.url + route, json=body, headers=headers, timeout=30)


def test_every_route_needs_the_key(server):
    app_routes = set(send(server, "GET", "/openapi.json").json()["paths"]) - OPEN_ROUTES
    assert {path for _, path, _ in ROUTES} >= app_routes, "a route is missing from ROUTES"
    for method, route, body in ROUTES:
        for key in (None, "wrong"):
            response = send(server, method, route, body, key=key)
            assert response.status_code == 401, (route, key)
            assert "API key" in response.json()["message"]
    assert send(server, "GET", "/openapi.json", key=None).status_code == 401
    for route in OPEN_ROUTES:  # SGLang leaves probes open (--api-key-open-paths)
        assert send(server, "GET", route, key=None).status_code == 200, route


def test_with_an_admin_key_admin_routes_take_only_it_and_the_others_only_the_api_key(admin_server):
    admin = [(method, route) for method, route, _ in ROUTES if is_admin_route(route)]
    assert len(admin) == 26 and ("POST", "/rollfleet/step") in admin and ("POST", "/generate") not in admin
    for method, route, body in ROUTES:
        wrong = KEY if is_admin_route(route) else ADMIN_KEY
        for key in (None, wrong):
            response = send(admin_server, method, route, body, key=key)
            assert response.status_code == 401, (route, key)
            assert response.json()["error"] == "Unauthorized"  # SGLang's body, and a message with the fix
            assert ("--admin-api-key" in response.json()["message"]) == is_admin_route(route), route
    for method, route, _ in ROUTES:
        # the right key passes the check: a body the route cannot parse (a list) answers 400, not 401
        right = ADMIN_KEY if is_admin_route(route) else KEY
        response = send(admin_server, method, route, [] if method == "POST" else None, key=right)
        assert response.status_code != 401, (route, response.text)
    scheme = {"Authorization": f"bearer {ADMIN_KEY}"}  # any case, as SGLang
    assert httpx.post(admin_server.url + "/continue_generation", json={}, headers=scheme).status_code == 200
    assert httpx.request("OPTIONS", admin_server.url + "/release_memory_occupation").status_code != 401
    for route in OPEN_ROUTES:
        assert send(admin_server, "GET", route, key=None).status_code == 200, route
    info = send(admin_server, "GET", "/get_server_info").json()
    assert info["admin_api_key_set"] and ADMIN_KEY not in str(info) and KEY not in str(info)


def test_the_client_sends_each_route_its_key(admin_server, qwen3_dir):
    async def go():
        async with EngineClient(admin_server.url, api_key=KEY, admin_api_key=ADMIN_KEY) as client:
            await client.pause_generation("in_place")
            await client.continue_generation()
            await client.update_weights_from_disk(qwen3_dir, weight_version="admin")
            out = await client.generate(input_ids=[1, 2], sampling_params={"max_new_tokens": 1})
            return out, (await client.get_model_info())["weight_version"]

    out, version = run(go())
    assert out["meta_info"]["weight_version"] == version == "admin"


@pytest.mark.parametrize(
    "raw, needle",
    [
        (b"{not json", "JSON"),
        (b'{"text": "a", "input_ids": [1]}', "exactly one"),
        (b'{"sampling_params": {}}', "exactly one"),
        (b'{"text": "a", "sampling_params": {"max_new_tokens": -1}}', "max_new_tokens"),
        (b'{"text": "a", "sampling_params": {"temperature": -0.5}}', "temperature"),
        (b'{"text": "a", "sampling_params": {"n": 0}}', "n:"),
        (b'{"text": "a", "sampling_params": {"top_p": 0}}', "top_p"),
        (b'{"text": "a", "sampling_params": {"top_k": 0}}', "top_k"),
        (b'{"input_ids": [' + b",".join([b"1"] * 600) + b"]}", "context length"),
        (b'{"input_ids": []}', "empty"),
        (b'{"text": ["a", "b"], "sampling_params": [{}]}', "one per prompt"),
    ],
)
def test_bad_generate_requests_get_400_and_the_server_keeps_serving(server, raw, needle):
    response = send(server, "POST", "/generate", raw=raw)
    assert response.status_code == 400
    assert needle in response.json()["message"], response.json()
    ok = send(
        server, "POST", "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}}
    )
    assert ok.status_code == 200 and len(ok.json()["output_ids"]) == 2


def test_bad_control_requests_get_400(server):
    assert send(server, "POST", "/update_weights_from_disk", {}).status_code == 400
    assert send(server, "POST", "/pause_generation", {"mode": "sideways"}).status_code == 400
    assert send(server, "POST", "/release_memory_occupation", {"tags": ["gpu"]}).status_code == 400
    assert send(server, "POST", "/abort_request", {}).status_code == 400


def _non_loopback_address() -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("10.255.255.255", 1))  # no packet is sent; picks the outgoing interface
            address = probe.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") else address


def test_binds_loopback_by_default(server):
    assert send(server, "GET", "/get_server_info").json()["host"] == "127.0.0.1"
    address = _non_loopback_address()
    if address is None:
        pytest.skip("this machine has no non-loopback address to probe")
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://{address}:{server.port}/health", timeout=5)


def test_pipeline_parallel_is_refused_with_a_message(qwen3_dir, capsys):
    """The server's own entry point, in this process: a second interpreter would spend seconds on imports."""
    with pytest.raises(SystemExit) as exit_:
        server_main(["--model-path", qwen3_dir, "--pp-size", "2"])
    assert exit_.value.code == 2
    stderr = capsys.readouterr().err
    assert "no pipeline parallel" in stderr and "SGLang" in stderr
