"""meta_info.routed_experts from real engine servers (tp=1, and tp=2 with expert parallel), checked
against the routers' top-k of a plain transformers forward of the same tiny Qwen3-MoE."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from conftest import _reference_model, call, engine_servers, shared_zygote

from rollfleet.engine.launch import EngineProcess, EngineStartError, embedded_argv
from rollfleet.wire.net import free_port
from rollfleet.wire.routed_experts import decode_routed_experts, encode_routed_experts

LAYERS, TOP_K = 2, 2  # the tiny Qwen3-MoE: 2 layers, 4 experts, 2 per token
FLAG = ["--enable-return-routed-experts"]
PROMPT = [5, 17, 42, 99, 7, 3]


@pytest.fixture(scope="module")
def servers(moe_dir, tmp_path_factory):
    plan = {
        "tp1": (moe_dir, {"extra": FLAG}),
        "ep2": (moe_dir, {"tp_size": 2, "ep_size": 2, "extra": FLAG}),
        "off": (moe_dir, {}),
    }
    with engine_servers(plan, tmp_path_factory.mktemp("routed-experts")) as procs:
        yield procs


def reference_routes(model_path: str, ids: list[int]) -> torch.Tensor:
    """[len(ids), layers, top_k]: each router's top-k over softmax(router logits), one full forward."""
    model = _reference_model(model_path)
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_router_logits=True)
    per_layer = [torch.topk(torch.softmax(logits.float(), -1), TOP_K, dim=-1).indices for logits in out.router_logits]
    return torch.stack(per_layer, dim=1)


def routes_of(answer: dict) -> torch.Tensor:
    return decode_routed_experts(answer["meta_info"]["routed_experts"], LAYERS, TOP_K)


def greedy(**extra) -> dict:
    return {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True, **extra}


def test_encoding_is_sglangs_int32_layout():
    routes = torch.tensor([[[0, 3], [2, 1]], [[1, 2], [3, 0]]], dtype=torch.int32)
    encoded = encode_routed_experts(routes)
    import base64

    import numpy

    assert numpy.frombuffer(base64.b64decode(encoded), dtype=numpy.int32).tolist() == [0, 3, 2, 1, 1, 2, 3, 0]
    assert torch.equal(decode_routed_experts(encoded, 2, 2), routes.long())
    with pytest.raises(ValueError, match="another model"):
        decode_routed_experts(encoded, 3, 2)


@pytest.mark.parametrize("server", ["tp1", "ep2"])
def test_routes_cover_prompt_and_output_but_the_last_token(servers, moe_dir, server):
    answer = call(servers[server], "generate", input_ids=PROMPT, sampling_params=greedy(), return_routed_experts=True)
    ids = PROMPT + answer["output_ids"]
    routes = routes_of(answer)
    assert routes.shape == (len(ids) - 1, LAYERS, TOP_K)
    assert torch.equal(routes, reference_routes(moe_dir, ids[:-1]))
    assert routes.min() >= 0 and routes.max() < 4


def test_start_len_drops_the_first_positions(servers, moe_dir):
    full = call(servers["tp1"], "generate", input_ids=PROMPT, sampling_params=greedy(), return_routed_experts=True)
    for start in (3, len(PROMPT)):
        part = call(
            servers["tp1"],
            "generate",
            input_ids=PROMPT,
            sampling_params=greedy(),
            return_routed_experts=True,
            routed_experts_start_len=start,
        )
        assert torch.equal(routes_of(part), routes_of(full)[start:])


def test_batch_and_n_each_sample_its_own_routes(servers, moe_dir):
    prompts = [PROMPT, [11, 12, 13]]  # different lengths: the shorter one is left-padded in the batch
    answers = call(
        servers["tp1"],
        "generate",
        input_ids=prompts,
        sampling_params=greedy(n=2, temperature=1.0, sampling_seed=3),
        return_routed_experts=True,
    )
    assert len(answers) == 4
    for index, answer in enumerate(answers):
        ids = prompts[index // 2] + answer["output_ids"]
        assert torch.equal(routes_of(answer), reference_routes(moe_dir, ids[:-1])), index


def test_stream_carries_routes_in_its_last_event_only(servers, moe_dir):
    body = {"input_ids": PROMPT, "sampling_params": greedy(), "stream": True, "return_routed_experts": True}
    with httpx.stream("POST", servers["tp1"].url + "/generate", json=body, timeout=60) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    assert len(events) == 5
    assert all("routed_experts" not in e["meta_info"] for e in events[:-1])
    last = events[-1]
    assert torch.equal(routes_of(last), reference_routes(moe_dir, (PROMPT + last["output_ids"])[:-1]))


def test_without_asking_no_routes(servers):
    answer = call(servers["tp1"], "generate", input_ids=PROMPT, sampling_params=greedy())
    assert "routed_experts" not in answer["meta_info"]


@pytest.mark.parametrize(
    ("server", "body", "words"),
    [
        ("off", {"return_routed_experts": True}, "--enable-return-routed-experts"),
        ("tp1", {"return_routed_experts": True, "routed_experts_start_len": 7}, "routed_experts_start_len=7"),
        ("tp1", {"return_routed_experts": True, "routed_experts_start_len": -1}, "routed_experts_start_len=-1"),
    ],
)
def test_refusals_name_the_field_and_the_server_stays_up(servers, server, body, words):
    url = servers[server].url
    response = httpx.post(url + "/generate", json={"input_ids": PROMPT, "sampling_params": greedy(), **body})
    assert response.status_code == 400 and words in response.json()["message"], response.text
    assert httpx.get(url + "/health").status_code == 200


def test_flag_on_a_dense_model_refused_at_start(qwen3_dir, tmp_path):
    port = free_port()
    proc = EngineProcess(
        embedded_argv(qwen3_dir, port, extra=FLAG), port=port, log_path=tmp_path / "dense.log", zygote=shared_zygote()
    )
    try:
        with pytest.raises(EngineStartError, match="dense model"):
            proc.wait_until_up(timeout=120)
    finally:
        proc.stop()
