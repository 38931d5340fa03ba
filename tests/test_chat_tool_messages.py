"""Multi-turn tool conversations on /v1/chat/completions, on a real embedded server whose
--chat-template renders tool calls, tool results and reasoning: the prompt is the one the same
template renders from the messages as SGLang 0.5.23 passes them (serving_chat.py
`_apply_jinja_template`: arguments parsed into dicts on assistant messages, content null as "",
null keys dropped, the rest kept); malformed calls are 400s naming the field; chat streams add up
to the answer."""

from __future__ import annotations

import json

import httpx
import pytest
from conftest import engine_server, reference_greedy
from transformers import AutoTokenizer

TEMPLATE = (
    "{% if tools %}{% for t in tools %}<tool>{{ t.function.name }}\n{% endfor %}{% endif %}"
    "{% for m in messages %}<{{ m.role }}>"
    "{% if m.reasoning_content is defined %}<think>{{ m.reasoning_content }}</think>{% endif %}"
    "{{ m.content }}"
    "{% if m.tool_calls is defined %}{% for c in m.tool_calls %}"
    "<call {{ c.id }} {{ c.index }}>{{ c.function.name }}{{ c.function.arguments | tojson }}"
    "{% for k, v in c.function.arguments.items() %}[{{ k }}={{ v }}]{% endfor %}</call>"
    "{% endfor %}{% endif %}"
    "{% if m.tool_call_id is defined %}<for {{ m.tool_call_id }}>{% endif %}"
    "{% if m.name is defined %}<name {{ m.name }}>{% endif %}\n"
    "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "paris"}'}}
CONVERSATION = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "weather in paris?", "name": "ann"},
    {"role": "assistant", "content": None, "tool_calls": [CALL], "reasoning_content": "ask the tool"},
    {"role": "tool", "content": [{"type": "text", "text": "sunny,"}, {"type": "text", "text": "21C"}],
     "tool_call_id": "call_1", "name": "get_weather"},
]  # fmt: skip
# what SGLang 0.5.23 hands the template for CONVERSATION
AS_SGLANG = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "weather in paris?"},  # its user message model has no name
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "ask the tool",
        "tool_calls": [
            {
                "id": "call_1",
                "index": None,
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "paris"}},
            },
        ],
    },  # fmt: skip
    {"role": "tool", "content": "sunny, 21C", "tool_call_id": "call_1", "name": "get_weather"},
]
TEMPLATE_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def server(qwen3_dir, tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(TEMPLATE)
    with engine_server(qwen3_dir, tmp_path_factory.mktemp("logs"), extra=["--chat-template", str(template)]) as proc:
        yield proc


def chat(server, body: dict) -> httpx.Response:
    return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)


def ok(response: httpx.Response) -> dict:
    assert response.status_code == 200, response.text
    return response.json()


def test_tool_calls_and_results_reach_the_template_as_sglang_passes_them(server, qwen3_dir):
    tokenizer = AutoTokenizer.from_pretrained(qwen3_dir)
    text = tokenizer.apply_chat_template(
        AS_SGLANG, tools=[{**TEMPLATE_TOOL, "defer_loading": None}], chat_template=TEMPLATE, tokenize=False,
        add_generation_prompt=True,
    )  # fmt: skip
    assert '<call call_1 None>get_weather{"city": "paris"}[city=paris]</call>' in text  # arguments as a dict
    assert "<for call_1><name get_weather>" in text and "<name ann>" not in text and "<think>ask" in text
    prompt = tokenizer.encode(text, add_special_tokens=False)
    body = {"messages": CONVERSATION, "tools": [TOOL], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    answer = ok(chat(server, body))
    assert answer["usage"]["prompt_tokens"] == len(prompt)
    expected = tokenizer.decode(reference_greedy(qwen3_dir, prompt, 8)[0], skip_special_tokens=False)
    assert answer["choices"][0]["message"]["content"] == expected


def test_arguments_already_an_object_and_calls_outside_assistant_messages(server, qwen3_dir):
    tokenizer = AutoTokenizer.from_pretrained(qwen3_dir)
    as_object = {**CALL, "index": 0, "function": {"name": "get_weather", "arguments": {"city": "paris"}}}
    messages = [CONVERSATION[1], {"role": "assistant", "content": "calling", "tool_calls": [as_object]}]
    messages.append({"role": "user", "content": "and?"})
    expected = [
        {"role": "user", "content": "weather in paris?"},
        {"role": "assistant", "content": "calling", "tool_calls": [{**as_object, "type": "function"}]},
        {"role": "user", "content": "and?"},
    ]
    text = tokenizer.apply_chat_template(expected, chat_template=TEMPLATE, tokenize=False, add_generation_prompt=True)
    assert "<call call_1 0>" in text
    answer = ok(chat(server, {"messages": messages, "max_tokens": 1}))
    assert answer["usage"]["prompt_tokens"] == len(tokenizer.encode(text, add_special_tokens=False))


@pytest.mark.parametrize(
    ("change", "needles"),
    [
        ({"arguments": "{bad"}, ["messages[2].tool_calls[0].function.arguments='{bad'", "not valid JSON"]),
        ({"arguments": "[1, 2]"}, ["messages[2].tool_calls[0].function.arguments='[1, 2]'", "a JSON object"]),
        ({"arguments": "NaN"}, ["function.arguments='NaN'", "not valid JSON"]),
        ({"arguments": 5}, ["messages[2].tool_calls[0].function.arguments=5", "as a string"]),
        ({"name": ["x"]}, ["messages[2].tool_calls[0].function.name=['x']", "a string"]),
    ],
)
def test_malformed_arguments_are_refused_naming_the_field(server, change, needles):
    call = {**CALL, "function": {**CALL["function"], **change}}
    messages = [*CONVERSATION[:2], {**CONVERSATION[2], "tool_calls": [call]}, CONVERSATION[3]]
    refused = chat(server, {"messages": messages, "max_tokens": 1})
    assert refused.status_code == 400, refused.text
    error = refused.json()
    assert error["object"] == "error" and all(needle in error["message"] for needle in needles), error
    assert '"arguments": "<a JSON object, as a string>"' in error["message"]  # the fix: the shape to send
    assert ok(chat(server, {"messages": CONVERSATION, "max_tokens": 1}))  # the server goes on serving


@pytest.mark.parametrize(
    ("calls", "needles"),
    [
        ("x", ["messages[2].tool_calls='x'", "a list of calls"]),
        ([5], ["messages[2].tool_calls[0]=5", "a JSON object"]),
        ([{**CALL, "type": "custom"}], ["messages[2].tool_calls[0].type='custom'"]),
        ([{"id": "c"}], ["messages[2].tool_calls[0].function=None", "needs a 'function'"]),
        ([{**CALL, "id": 7}], ["messages[2].tool_calls[0].id=7", "a string or null"]),
    ],
)
def test_malformed_tool_calls_are_refused_naming_the_field(server, calls, needles):
    messages = [*CONVERSATION[:2], {**CONVERSATION[2], "tool_calls": calls}]
    refused = chat(server, {"messages": messages, "max_tokens": 1})
    assert refused.status_code == 400 and all(needle in refused.json()["message"] for needle in needles), refused.text


def test_bad_message_fields_are_refused_naming_them(server):
    for field, value in (("tool_call_id", 5), ("name", {"a": 1}), ("reasoning_content", ["x"])):
        refused = chat(server, {"messages": [{**CONVERSATION[3], field: value}], "max_tokens": 1})
        assert refused.status_code == 400, refused.text
        assert f"messages.0.{field}" in refused.json()["message"] and str(value) in refused.json()["message"]


def test_chat_stream_adds_up_to_the_answer(server):
    body = {"messages": CONVERSATION, "max_tokens": 40, "temperature": 1.0, "ignore_eos": True, "n": 2}
    for seed in range(3):
        answer = ok(chat(server, {**body, "seed": seed}))
        content = answer["choices"][0]["message"]["content"]
        stop = next(content[i : i + 2] for i in range(5, len(content) - 2) if "\ufffd" not in content[i : i + 2])
        for extra in ({}, {"stop": stop}, {"stop": stop, "no_stop_trim": True}, {"skip_special_tokens": False}):
            expected = ok(chat(server, {**body, "seed": seed, **extra}))["choices"]
            raw = chat(server, {**body, "seed": seed, **extra, "stream": True}).text.split("\n\n")[:-2]
            chunks = [json.loads(chunk.removeprefix("data: ")) for chunk in raw]
            for index in (0, 1):
                deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"][0]["index"] == index]
                streamed = "".join(delta.get("content", "") for delta in deltas)
                assert streamed == expected[index]["message"]["content"], (seed, extra)
