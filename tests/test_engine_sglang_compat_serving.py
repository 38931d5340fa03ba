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
TEMPLATE = (  # renders tools as many models' templates do (`tool | tojson`); kwargs make it ignore them, or
    # take bare functions only (as Mistral's)
    "{% if tools and not hide_tools %}{% for t in tools %}"
    "{% if bare_functions and t.function is defined %}{{ raise_exception('bare functions only') }}{% endif %}"
    "<tool>{{ t | tojson }}\n{% endfor %}{% endif %}"
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


@pytest.fixture(autouse=True)
def on_qwen3_dir(server, qwen3_dir):
    """Each test starts on qwen3_dir's weights at version "default" (one test loads others)."""
    if ok(httpx.get(server.url + "/get_model_info", headers=AUTH))["weight_version"] != "default":
        ok(post(server, "/update_weights_from_disk", {"model_path": qwen3_dir, "weight_version": "default"}))


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
    # SGLang's token ids on each choice: an agent framework keeps the exact tokens of a conversation
    ids = ok(post(server, "/v1/chat/completions", {**body, "return_token_ids": True}))["choices"][0]
    assert ids["prompt_token_ids"] == prompt and ids["response_token_ids"] == expected
    assert "prompt_token_ids" not in choice and "response_token_ids" not in choice
    refused = post(server, "/v1/chat/completions", {**body, "return_token_ids": True, "stream": True})
    assert refused.status_code == 400 and "streaming" in refused.json()["message"]
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


WEATHER = {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
TOOL = {"type": "function", "function": WEATHER}


TOOLS = [{"type": "function", "function": WEATHER, "extra": 1}]
ASK = [{"role": "user", "content": "weather in paris?"}]


def tools_prompt(tokenizer, bare: bool = False) -> list[int]:
    """ASK with TOOLS as SGLang 0.5.23 renders them: its Tool.model_dump() keeps the function's fields as
    sent, then the missing ones as null, drops unknown ones, and adds the tool's defer_loading; a
    template that fails on that gets the bare functions."""
    function = {**WEATHER, "description": None}
    rendered = function if bare else {"type": "function", "function": function, "defer_loading": None}
    text = tokenizer.apply_chat_template(
        ASK, tools=[rendered], chat_template=TEMPLATE, tokenize=False, add_generation_prompt=True
    )
    assert text.startswith('<tool>{"name": "get_weather"' if bare else '<tool>{"type": "function", "function": ')
    return tokenizer.encode(text, add_special_tokens=False)


def test_chat_renders_tools_into_the_template_as_sglang(server, qwen3_dir):
    tokenizer = AutoTokenizer.from_pretrained(qwen3_dir)
    prompt = tools_prompt(tokenizer)
    body = {"messages": ASK, "tools": TOOLS, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    for choice in (None, "auto"):
        answer = ok(post(server, "/v1/chat/completions", {**body, "tool_choice": choice}))
        assert answer["usage"]["prompt_tokens"] == len(prompt)
        message = answer["choices"][0]["message"]
        # no tool-call parser: the model's raw text is the content
        expected = tokenizer.decode(reference_greedy(qwen3_dir, prompt, 8)[0], skip_special_tokens=False)
        assert message["content"] == expected and message["tool_calls"] is None
    untouched = tokenizer.encode("<user>weather in paris?\n<assistant>", add_special_tokens=False)
    unrendered = ok(post(server, "/v1/chat/completions", {**body, "tool_choice": "none"}))
    assert unrendered["usage"]["prompt_tokens"] == len(untouched)
    bare = ok(post(server, "/v1/chat/completions", {**body, "chat_template_kwargs": {"bare_functions": True}}))
    assert bare["usage"]["prompt_tokens"] == len(tools_prompt(tokenizer, bare=True))


def test_chat_with_tools_keeps_special_tokens_in_the_text_as_sglang(server, qwen3_dir):
    tokenizer = AutoTokenizer.from_pretrained(qwen3_dir)
    prompt, sampled = tools_prompt(tokenizer), {"temperature": 1.0, "ignore_eos": True, "max_new_tokens": 64}
    for seed in range(20):  # a sample with a special token in it (the tiny model's are close to uniform)
        params = {**sampled, "sampling_seed": seed, "skip_special_tokens": False}
        out = ok(post(server, "/generate", {"input_ids": prompt, "sampling_params": params}))
        if set(out["output_ids"]) & set(tokenizer.all_special_ids):
            break
    else:
        pytest.fail("no sample of 20 held a special token")
    body = {"messages": ASK, "tools": TOOLS, "max_tokens": 64, "temperature": 1.0, "ignore_eos": True, "seed": seed}
    content = ok(post(server, "/v1/chat/completions", body))["choices"][0]["message"]["content"]
    assert content == out["text"] != tokenizer.decode(out["output_ids"], skip_special_tokens=True)


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
        # tools were dropped silently before: a malformed one, a forced call, a template that ignores them
        ("/v1/chat/completions", {"messages": text_part("hi"), "tools": ["x"]}, ["tools[0]='x'", '"type": "function"']),
        ("/v1/chat/completions", {"messages": text_part("hi"), "tools": [TOOL, {"type": "custom"}]}, ["tools[1].type"]),
        (
            "/v1/chat/completions",
            {"messages": text_part("hi"), "tools": [{"function": {"description": "d"}}]},
            ["tools[0].function.name=None", "a function needs a 'name'"],
        ),
        (
            "/v1/chat/completions",
            {"messages": text_part("hi"), "tools": [TOOL], "tool_choice": "required"},
            ["tool_choice='required'", "constrained decoding", "'auto'", "rollout.backend=sglang"],
        ),
        (
            "/v1/chat/completions",
            {"messages": text_part("hi"), "tools": [TOOL], "tool_choice": {"type": "function", "function": WEATHER}},
            ["tool_choice=", "get_weather", "constrained decoding"],
        ),
        ("/v1/chat/completions", {"messages": text_part("hi"), "tool_choice": "maybe"}, ["tool_choice='maybe'"]),
        (
            "/v1/chat/completions",
            {"messages": text_part("hi"), "chat_template_kwargs": {"tools": [TOOL]}},
            ["chat_template_kwargs.tools", "`tools` field"],
        ),
        (
            "/v1/chat/completions",
            {"messages": text_part("hi"), "tools": [TOOL], "chat_template_kwargs": {"hide_tools": True}},
            ["tools:", "same prompt without the 1 tools", "--chat-template", "tool_choice 'none'"],
        ),
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
