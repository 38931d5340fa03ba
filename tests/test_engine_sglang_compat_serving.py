"""SGLang 0.5.23's serving surface on a real embedded server started with --api-key, --chat-template
and --enable-weights-cpu-backup: the OpenAI routes, auth as SGLang does it, and the shapes of
status, control and memory answers (release + resume keeps serving; a disk update while released
loads the weights)."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from conftest import engine_server, reference_greedy
from safetensors.torch import load_file
from transformers import AutoTokenizer

KEY = "k3y"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = [5, 17, 42, 99, 7, 150, 23]
TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
    "{% if greeting %}{{ greeting }}{% endif %}{% if add_generation_prompt %}<assistant>{% endif %}"
)


@pytest.fixture(scope="module")
def server(qwen3_dir, tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(TEMPLATE)
    extra = ["--chat-template", str(template), "--enable-weights-cpu-backup", "--served-model-name", "tiny"]
    with engine_server(qwen3_dir, tmp_path_factory.mktemp("logs"), api_key=KEY, extra=extra) as proc:
        yield proc


def post(server, route: str, body: dict | None = None, headers=AUTH) -> httpx.Response:
    return httpx.post(server.url + route, json=body, headers=headers, timeout=60)


def ok(response: httpx.Response):
    assert response.status_code == 200, response.text
    return response.json() if response.content else None


def events(response: httpx.Response) -> list:
    chunks = response.text.split("\n\n")
    assert chunks[-2:] == ["data: [DONE]", ""]
    return [json.loads(chunk.removeprefix("data: ")) for chunk in chunks[:-2]]


def test_completions_match_generate_with_logprobs_n_and_usage(server):
    body = {"prompt": PROMPT, "max_tokens": 5, "temperature": 0, "ignore_eos": True, "n": 2, "logprobs": 2}
    answer = ok(post(server, "/v1/completions", {**body, "rid": "c1"}))
    greedy = {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}
    expected = ok(post(server, "/generate", {"input_ids": PROMPT, "sampling_params": greedy}))
    assert answer["object"] == "text_completion" and answer["model"] == "default"
    assert [c["index"] for c in answer["choices"]] == [0, 1]
    for choice in answer["choices"]:
        assert choice["text"] == expected["text"] and choice["finish_reason"] == "length"
        logprobs = choice["logprobs"]
        assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == len(logprobs["top_logprobs"]) == 5
        assert all(len(top) <= 2 for top in logprobs["top_logprobs"])
    assert answer["usage"] == {"prompt_tokens": len(PROMPT), "completion_tokens": 10, "total_tokens": len(PROMPT) + 10}


def test_completions_stream_with_usage_adds_up_to_the_answer(server):
    body = {"prompt": "what is 12", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    answer = ok(post(server, "/v1/completions", body))
    streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
    chunks = events(post(server, "/v1/completions", streamed))
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == answer["choices"][0]["text"]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == answer["usage"]


def test_chat_uses_the_template_and_its_kwargs(server, qwen3_dir):
    tokenizer = AutoTokenizer.from_pretrained(qwen3_dir)
    messages = [{"role": "user", "content": [{"type": "text", "text": "add 2 and 3"}]}]
    body = {"messages": messages, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": True}
    answer = ok(post(server, "/v1/chat/completions", {**body, "top_logprobs": 2, "separate_reasoning": True}))
    prompt = tokenizer.encode("<user>add 2 and 3\n<assistant>", add_special_tokens=False)
    expected = reference_greedy(qwen3_dir, prompt, 6)[0]
    choice = answer["choices"][0]
    assert answer["object"] == "chat.completion" and choice["message"]["role"] == "assistant"
    assert choice["message"]["content"] == tokenizer.decode(expected)
    assert answer["usage"]["prompt_tokens"] == len(prompt)
    content = choice["logprobs"]["content"]
    assert len(content) == 6 and all(len(entry["top_logprobs"]) == 2 for entry in content)
    assert content[0]["bytes"] == list(content[0]["token"].encode())
    greeted = ok(post(server, "/v1/chat/completions", {**body, "chat_template_kwargs": {"greeting": "hi there"}}))
    assert greeted["usage"]["prompt_tokens"] > len(prompt)  # the template saw the kwarg


def test_chat_stream_sends_the_role_then_deltas(server):
    body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 5, "temperature": 0, "n": 2}
    answer = ok(post(server, "/v1/chat/completions", {**body, "ignore_eos": True}))
    chunks = events(post(server, "/v1/chat/completions", {**body, "ignore_eos": True, "stream": True}))
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert "".join(c["delta"].get("content", "") for c in mine) == answer["choices"][index]["message"]["content"]
        assert mine[-1]["finish_reason"] == "length"


def text_part(text) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": text}]}]


def test_openai_errors_have_openai_shape(server):
    for route, body, needles in [
        ("/v1/chat/completions", {"messages": []}, ["messages"]),
        ("/v1/completions", {"prompt": "x", "temperature": -1}, ["temperature"]),
        ("/v1/completions", {"prompt": [10**6]}, ["1000000"]),
        # these three were 500s: an empty batch of prompts, and content parts read unchecked
        ("/v1/completions", {"prompt": []}, ["prompt is an empty list"]),
        ("/v1/chat/completions", {"messages": text_part("a\ud800")}, ["text", "surrogate"]),
        ("/v1/chat/completions", {"messages": text_part({"x": 1})}, ["text", "valid string", "{'x': 1}"]),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, ["needs 'text'"]),
        # ignored before, so the answer looked constrained when it was not
        ("/v1/chat/completions", {"messages": text_part("hi"), "response_format": {"type": "json_object"}}, ["json"]),
        ("/v1/completions", {"prompt": "x", "regex": "[0-9]+"}, ["regex='[0-9]+'", "constrained decoding"]),
        ("/v1/completions", {"prompt": "x", "frequency_penalty": 0.5}, ["frequency_penalty=0.5", "no penalties"]),
    ]:
        raw = json.dumps(body)  # a lone surrogate travels as its \\ud800 escape
        headers = {**AUTH, "content-type": "application/json"}
        response = httpx.post(server.url + route, content=raw, headers=headers, timeout=60)
        assert response.status_code == 400, response.text
        error = response.json()
        assert error["object"] == "error" and error["code"] == 400, error
        assert all(needle in error["message"] for needle in needles), error


def test_models_and_loads(server, qwen3_dir):
    models = ok(httpx.get(server.url + "/v1/models", headers=AUTH))
    assert models["object"] == "list" and models["data"][0]["id"] == "tiny"
    loads = ok(httpx.get(server.url + "/v1/loads", headers=AUTH))
    assert loads["loads"][0]["num_running_reqs"] == 0 and loads["loads"][0]["max_running_requests"] > 0
    assert {"timestamp", "version", "num_accelerators"} <= set(loads)


def test_auth_as_sglang_does_it(server):
    for route in ("/health", "/health_generate", "/ready"):
        assert httpx.get(server.url + route).status_code == 200, route
    assert httpx.request("OPTIONS", server.url + "/generate").status_code != 401
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1}}
    assert post(server, "/generate", body, headers={"Authorization": f"bEaReR {KEY}"}).status_code == 200
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"}):
        assert post(server, "/generate", body, headers=headers).status_code == 401, headers
    assert httpx.get(server.url + "/v1/models").status_code == 401


def test_status_and_control_shapes(server, qwen3_dir):
    info = ok(httpx.get(server.url + "/get_server_info", headers=AUTH))
    assert info["max_total_num_tokens"] > 0 and "api_key" not in info
    rows = ok(post(server, "/get_weights_by_name", {"name": "model.embed_tokens.weight", "truncate_size": 3}))
    stored = load_file(f"{qwen3_dir}/model.safetensors")["model.embed_tokens.weight"]
    assert torch.tensor(rows).shape == (3, stored.shape[1])  # param[:3]: the first 3 rows, not 3 values
    torch.testing.assert_close(torch.tensor(rows), stored[:3].float())
    assert ok(post(server, "/pause_generation", {"mode": "in_place"})) == {
        "message": "Generation paused successfully.",
        "status": "ok",
    }
    assert ok(post(server, "/continue_generation", {}))["status"] == "ok"
    assert ok(post(server, "/abort_request", {"abort_all": True})) is None


def test_release_resume_keeps_serving_and_disk_updates_load_while_released(server, qwen3_dir, qwen3_dir_b):
    body = {"input_ids": PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}}
    assert ok(post(server, "/release_memory_occupation", {"tags": None})) is None
    assert httpx.get(server.url + "/ready").status_code == 503
    assert post(server, "/generate", body).status_code == 503
    assert ok(post(server, "/resume_memory_occupation", {"tags": None})) is None
    assert ok(post(server, "/generate", body))["output_ids"] == reference_greedy(qwen3_dir, PROMPT, 6)[0]
    ok(post(server, "/release_memory_occupation", {"tags": ["weights"]}))
    refused = post(server, "/update_weights_from_disk", {"model_path": "/nonexistent"})
    assert refused.status_code == 400 and post(server, "/generate", body).status_code == 503  # still released
    ok(post(server, "/update_weights_from_disk", {"model_path": qwen3_dir_b, "weight_version": "b"}))
    answer = ok(post(server, "/generate", body))
    assert answer["output_ids"] == reference_greedy(qwen3_dir_b, PROMPT, 6)[0]
    assert answer["meta_info"]["weight_version"] == "b"
    assert ok(httpx.get(server.url + "/get_model_info", headers=AUTH))["model_path"] == qwen3_dir_b
