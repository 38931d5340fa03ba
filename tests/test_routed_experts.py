"""meta_info.routed_experts from real engine servers (tp=1, and tp=2 with expert parallel), checked
against the routers' top-k of a plain transformers forward of the same tiny Qwen3-MoE."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from conftest import _reference_model, call, engine_servers, shared_zygote

from rollfleet.engine.process.launch import EngineProcess, EngineStartError, embedded_argv
from rollfleet.wire.net import free_port
from rollfleet.wire.routed_experts import decode_routed_experts, encode_routed_experts

LAYERS, TOP_K = 2, 2  # the tiny Qwen3-MoE: 2 layers, 4 experts, 2 per token
FLAG = ["--enable-return-routed-experts"]
PROMPT = [5, 17, 42, 99, 7, 3]
TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}<assistant>"


@pytest.fixture(scope="module")
def servers(moe_dir, tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(TEMPLATE)
    plan = {
        "tp1": (moe_dir, {"extra": [*FLAG, "--chat-template", str(template)]}),
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
    # invariants, not a count (events coalesce when tokens come faster than they are sent): each
    # event's tokens extend the one before, the last is the whole answer and alone carries routes
    counts = [len(e["output_ids"]) for e in events]
    assert counts == sorted(set(counts)) and counts[-1] == greedy()["max_new_tokens"], counts
    assert all(a["output_ids"] == b["output_ids"][: len(a["output_ids"])] for a, b in zip(events, events[1:]))
    assert [e["meta_info"]["finish_reason"] is None for e in events] == [True] * (len(events) - 1) + [False]
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


# ---- the OpenAI routes: SGLang 0.5.23's `sglext.routed_experts` and `metadata` ------------------------
def openai(server, route: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + route, json=body, timeout=60)


def sse_events(response: httpx.Response) -> list[dict]:
    chunks = response.text.split("\n\n")
    assert chunks[-2:] == ["data: [DONE]", ""], response.text
    return [json.loads(chunk.removeprefix("data: ")) for chunk in chunks[:-2]]


def chat_ids(moe_dir: str, messages: list[dict]) -> list[int]:
    """The prompt ids the engine makes of `messages` (its --chat-template, no special tokens added)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(moe_dir)
    text = tokenizer.apply_chat_template(messages, tokenize=False, chat_template=TEMPLATE, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


GREEDY_OPENAI = {"max_tokens": 5, "temperature": 0, "ignore_eos": True}
MESSAGES = [{"role": "user", "content": "route me"}]


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_openai_routes_answer_routes_and_weight_versions_as_sglang(servers, moe_dir, route):
    """Non-streamed: `sglext.routed_experts` at the response level (not on a choice), encoded as
    /generate's meta_info.routed_experts and honouring routed_experts_start_len; `metadata` holds the
    weight version and its spans; without asking, no sglext."""
    server = servers["tp1"]
    chat = route == "/v1/chat/completions"
    ids = chat_ids(moe_dir, MESSAGES) if chat else PROMPT
    request = {**GREEDY_OPENAI, **({"messages": MESSAGES} if chat else {"prompt": PROMPT})}
    generated = call(server, "generate", input_ids=ids, sampling_params=greedy(), return_routed_experts=True)
    answer = openai(server, route, {**request, "return_routed_experts": True}).json()
    assert answer["sglext"] == {"routed_experts": generated["meta_info"]["routed_experts"]}, answer
    assert all("routed_experts" not in choice for choice in answer["choices"])
    routes = decode_routed_experts(answer["sglext"]["routed_experts"], LAYERS, TOP_K)
    assert torch.equal(routes, reference_routes(moe_dir, (ids + generated["output_ids"])[:-1]))
    meta = generated["meta_info"]
    assert answer["metadata"] == {"weight_version": meta["weight_version"], "weight_versions": meta["weight_versions"]}
    part = openai(server, route, {**request, "return_routed_experts": True, "routed_experts_start_len": 3}).json()
    assert torch.equal(decode_routed_experts(part["sglext"]["routed_experts"], LAYERS, TOP_K), routes[3:])
    plain = openai(server, route, request).json()
    assert "sglext" not in plain and plain["metadata"]["weight_version"] == meta["weight_version"]


def test_openai_n_reports_the_first_answers_routes(servers):
    """SGLang reports one set of routes per response: the first answer's, also with n > 1."""
    server = servers["tp1"]
    sampling = greedy(n=2, temperature=1.0, sampling_seed=3)
    generated = call(server, "generate", input_ids=PROMPT, sampling_params=sampling, return_routed_experts=True)
    body = {"prompt": PROMPT, "max_tokens": 5, "n": 2, "temperature": 1.0, "seed": 3, "ignore_eos": True}
    answer = openai(server, "/v1/completions", {**body, "return_routed_experts": True}).json()
    assert [c["text"] for c in answer["choices"]] == [g["text"] for g in generated]
    assert answer["sglext"] == {"routed_experts": generated[0]["meta_info"]["routed_experts"]}


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_openai_streams_send_routes_in_a_chunk_of_their_own_before_usage(servers, route):
    """Streamed, as SGLang: after every choice finished, one chunk with no choices carries `sglext`,
    then the usage chunk; no chunk has `metadata` (SGLang's stream chunks have no such field)."""
    server = servers["tp1"]
    chat = route == "/v1/chat/completions"
    request = {
        **GREEDY_OPENAI,
        "return_routed_experts": True,
        **({"messages": MESSAGES} if chat else {"prompt": PROMPT}),
    }
    whole = openai(server, route, request).json()
    chunks = sse_events(openai(server, route, {**request, "stream": True, "stream_options": {"include_usage": True}}))
    *tokens, extension, counted = chunks
    assert extension["choices"] == [] and extension["sglext"] == whole["sglext"]
    assert counted["choices"] == [] and counted["usage"] == whole["usage"] and "sglext" not in counted
    assert tokens[-1]["choices"][0]["finish_reason"] == "length"
    assert all("sglext" not in c and "metadata" not in c for c in tokens)
    unasked = sse_events(openai(server, route, {**request, "return_routed_experts": False, "stream": True}))
    assert all("sglext" not in c for c in unasked)


def test_openai_refusal_names_the_flag_and_the_server_stays_up(servers):
    url = servers["off"].url
    response = httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "return_routed_experts": True})
    assert response.status_code == 400 and "--enable-return-routed-experts" in response.json()["message"]
    assert httpx.get(url + "/health").status_code == 200
