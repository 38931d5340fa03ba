"""/generate as SGLang 0.5.23 answers it, on a real embedded server: input logprobs
(logprob_start_len), top_logprobs_num, token_ids_logprob, return_text_in_logprobs, no_stop_trim,
and stream: true (SGLang's SSE events, `index` for batches). Logprobs are checked against a plain
transformers forward pass of the same tiny model."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from conftest import engine_server
from transformers import AutoModelForCausalLM, AutoTokenizer

PROMPT = [5, 17, 42, 99, 7, 150, 23]
GREEDY = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(qwen3_dir, tmp_path_factory):
    with engine_server(qwen3_dir, tmp_path_factory.mktemp("logs")) as proc:
        yield proc


@pytest.fixture(scope="module")
def reference(qwen3_dir):
    """log_softmax over every position of prompt + tokens, from transformers alone."""
    model = AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype=torch.float32).eval()

    def logprobs(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)

    return logprobs


def generate(server, **body) -> dict | list:
    response = httpx.post(server.url + "/generate", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def test_input_logprobs_match_a_forward_pass(server, reference):
    start = 2
    out = generate(server, input_ids=PROMPT, sampling_params=GREEDY, return_logprob=True, logprob_start_len=start)
    expected = reference(PROMPT)
    entries = out["meta_info"]["input_token_logprobs"]
    assert [e[1] for e in entries] == PROMPT[start:]  # one per prompt token from the start
    assert entries[0][0] is None  # SGLang: the first entry has no logprob, whatever the start
    for offset, (value, token, text) in enumerate(entries[1:], start + 1):
        assert value == pytest.approx(float(expected[offset - 1, token]), abs=1e-4)
        assert text is None
    assert len(out["meta_info"]["output_token_logprobs"]) == out["meta_info"]["output_token_logprobs_length"] == 6


def test_logprob_start_len_edges(server):
    whole = generate(server, input_ids=PROMPT, sampling_params=GREEDY, return_logprob=True, logprob_start_len=0)
    assert len(whole["meta_info"]["input_token_logprobs"]) == len(PROMPT)
    none = generate(server, input_ids=PROMPT, sampling_params=GREEDY, return_logprob=True)
    assert none["meta_info"]["input_token_logprobs"] == []  # -1: output logprobs only, as SGLang
    assert none["output_ids"] == whole["output_ids"]
    response = httpx.post(
        server.url + "/generate",
        json={"input_ids": PROMPT, "return_logprob": True, "logprob_start_len": len(PROMPT) + 1},
        timeout=30,
    )
    assert response.status_code == 400 and "logprob_start_len" in response.json()["message"]


def test_top_and_chosen_logprobs_with_text(server, reference, qwen3_dir):
    tokenizer = AutoTokenizer.from_pretrained(qwen3_dir)
    chosen = [3, 40, 77]
    out = generate(
        server,
        input_ids=PROMPT,
        sampling_params=GREEDY,
        return_logprob=True,
        logprob_start_len=4,
        top_logprobs_num=3,
        token_ids_logprob=chosen,
        return_text_in_logprobs=True,
    )
    meta = out["meta_info"]
    expected = reference(PROMPT + out["output_ids"])
    assert meta["input_top_logprobs"][0] is None and meta["input_token_ids_logprobs"][0] is None
    assert len(meta["input_top_logprobs"]) == len(PROMPT) - 4
    for position, row in enumerate(meta["input_top_logprobs"][1:], 4):
        values, ids = torch.topk(expected[position], 3)
        assert [e[1] for e in row] == ids.tolist()
        assert [e[0] for e in row] == pytest.approx(values.tolist(), abs=1e-4)
        assert [e[2] for e in row] == [tokenizer.decode([i]) for i in ids.tolist()]
    for step, (row, token) in enumerate(zip(meta["output_top_logprobs"], out["output_ids"])):
        position = len(PROMPT) - 1 + step
        assert row[0][1] == token  # greedy: the chosen token is the most likely
        assert [e[0] for e in row] == pytest.approx(torch.topk(expected[position], 3).values.tolist(), abs=1e-4)
        ids_row = meta["output_token_ids_logprobs"][step]
        assert [e[1] for e in ids_row] == chosen
        assert [e[0] for e in ids_row] == pytest.approx(expected[position, chosen].tolist(), abs=1e-4)
    assert all(isinstance(e[2], str) for e in meta["output_token_logprobs"])


def test_input_logprobs_in_a_padded_batch_with_n(server, reference):
    prompts = [PROMPT, PROMPT[:4]]
    outs = generate(
        server,
        input_ids=prompts,
        sampling_params={**GREEDY, "n": 2},
        return_logprob=True,
        logprob_start_len=1,
    )
    assert len(outs) == 4
    for index, out in enumerate(outs):
        prompt = prompts[index // 2]
        expected = reference(prompt)
        values = [e[0] for e in out["meta_info"]["input_token_logprobs"][1:]]
        assert values == pytest.approx([float(expected[p - 1, prompt[p]]) for p in range(2, len(prompt))], abs=1e-4)


def test_no_stop_trim_keeps_the_stop_string_and_token(server, qwen3_dir):
    tokenizer = AutoTokenizer.from_pretrained(qwen3_dir)
    params = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    full = generate(server, input_ids=PROMPT, sampling_params=params)
    ids = full["output_ids"]
    stop_token = ids[4]
    first = ids.index(stop_token)
    trimmed = generate(server, input_ids=PROMPT, sampling_params={**params, "stop_token_ids": [stop_token]})
    kept = generate(
        server, input_ids=PROMPT, sampling_params={**params, "stop_token_ids": [stop_token], "no_stop_trim": True}
    )
    assert trimmed["output_ids"] == kept["output_ids"] == ids[: first + 1]  # output_ids keep the stop token
    assert trimmed["text"] == tokenizer.decode(ids[:first])  # SGLang trims its text
    assert kept["text"] == tokenizer.decode(ids[: first + 1])
    text = tokenizer.decode(ids)
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    cut = text.index(stop)
    trimmed = generate(server, input_ids=PROMPT, sampling_params={**params, "stop": stop})
    kept = generate(server, input_ids=PROMPT, sampling_params={**params, "stop": stop, "no_stop_trim": True})
    assert trimmed["text"] == text[:cut] and kept["text"] == text[: cut + len(stop)]
    assert kept["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}


def stream(server, body: dict) -> list[dict]:
    """The events of a streamed /generate, checking SGLang's framing; [DONE] comes last."""
    events = []
    with httpx.stream("POST", server.url + "/generate", json={**body, "stream": True}, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    chunks = raw.split("\n\n")
    assert chunks[-2:] == ["data: [DONE]", ""]
    for chunk in chunks[:-2]:
        assert chunk.startswith("data: ")
        events.append(json.loads(chunk[len("data: ") :]))
    return events


def test_stream_is_cumulative_and_ends_with_the_answer(server):
    body = {"input_ids": PROMPT, "sampling_params": GREEDY, "return_logprob": True}
    events = stream(server, body)
    answer = generate(server, **body)
    assert events[-1]["output_ids"] == answer["output_ids"] and events[-1]["text"] == answer["text"]
    assert events[-1]["meta_info"]["finish_reason"] == answer["meta_info"]["finish_reason"]
    for event in events[:-1]:
        assert event["meta_info"]["finish_reason"] is None and "index" not in event
        count = len(event["output_ids"])
        assert event["output_ids"] == answer["output_ids"][:count]
        assert len(event["meta_info"]["output_token_logprobs"]) == count == event["meta_info"]["completion_tokens"]
    counts = [len(e["output_ids"]) for e in events]  # events coalesce: how many there are is the machine's speed
    assert counts == sorted(set(counts)), counts


def test_stream_of_a_batch_with_n_carries_prompt_major_index(server):
    prompts = [PROMPT, PROMPT[:3]]
    events = stream(server, {"input_ids": prompts, "sampling_params": {**GREEDY, "n": 2}})
    finals = {e["index"]: e for e in events if e["meta_info"]["finish_reason"] is not None}
    assert sorted(finals) == [0, 1, 2, 3]
    answers = generate(server, input_ids=prompts, sampling_params=GREEDY)
    for index, final in finals.items():
        assert final["output_ids"] == answers[index // 2]["output_ids"]  # greedy: a prompt's samples agree
    single_n = stream(server, {"input_ids": PROMPT, "sampling_params": {**GREEDY, "n": 2}})
    assert {e["index"] for e in single_n} == {0, 1}  # n > 1 makes SGLang treat one prompt as a batch


def test_bad_logprob_fields_are_refused_and_the_server_keeps_serving(server):
    for body, needle in [
        ({"input_ids": PROMPT, "return_logprob": True, "token_ids_logprob": [10**6]}, "token_ids_logprob"),
        ({"input_ids": PROMPT, "top_logprobs_num": -1}, "top_logprobs_num"),
        ({"input_ids": PROMPT, "logprob_start_len": -2}, "logprob_start_len"),
    ]:
        response = httpx.post(server.url + "/generate", json=body, timeout=30)
        assert response.status_code == 400 and needle in response.json()["message"], response.text
    assert generate(server, input_ids=PROMPT, sampling_params=GREEDY)["output_ids"]


def test_engine_client_sends_every_generate_field(server):
    """EngineClient.generate / generate_stream: the same answers as the raw HTTP bodies above."""
    from conftest import client_for, run

    from rollfleet.wire.client import EngineError

    fields = {
        "input_ids": PROMPT,
        "sampling_params": {**GREEDY, "stop": ["zz"], "no_stop_trim": True},
        "return_logprob": True,
        "logprob_start_len": 1,
        "top_logprobs_num": 2,
        "token_ids_logprob": [3, 9],
        "return_text_in_logprobs": True,
    }

    async def go():
        async with client_for(server) as client:
            answer = await client.generate(**fields)
            events = [event async for event in client.generate_stream(**fields)]
            with pytest.raises(EngineError) as err:
                await client.generate(input_ids=PROMPT, top_logprobs_num=-1)
            with pytest.raises(EngineError) as stream_err:
                _ = [event async for event in client.generate_stream(input_ids=PROMPT, logprob_start_len=-2)]
            return answer, events, err.value, stream_err.value

    answer, events, err, stream_err = run(go())
    raw = generate(server, **fields)

    def stable(out: dict) -> dict:  # without the request's id and timings
        meta = {k: v for k, v in out["meta_info"].items() if k != "id" and "latency" not in k and "time" not in k}
        return {**out, "meta_info": meta}

    assert stable(answer) == stable(raw) and set(raw["meta_info"]) >= {
        "input_token_logprobs",
        "input_top_logprobs",
        "input_token_ids_logprobs",
        "output_top_logprobs",
        "output_token_ids_logprobs",
    }
    assert len(answer["meta_info"]["input_token_logprobs"]) == len(PROMPT) - 1
    assert answer["meta_info"]["output_token_logprobs"][0][2] is not None  # return_text_in_logprobs arrived
    assert events[-1]["output_ids"] == raw["output_ids"] and events[-1]["meta_info"]["finish_reason"] is not None
    # an event per token, each cumulative; a token whose sequence finished before its event was sent
    # is covered by the final answer (SGLang also sends only the latest state when several are pending)
    counts = [len(e["output_ids"]) for e in events]
    assert counts == sorted(set(counts)) and counts[-1] == len(raw["output_ids"]), counts
    assert all(e["output_ids"] == raw["output_ids"][: len(e["output_ids"])] for e in events)
    assert err.status_code == 400 and "top_logprobs_num" in err.message
    assert stream_err.status_code == 400 and "logprob_start_len" in stream_err.message
