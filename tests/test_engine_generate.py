"""/generate on a real embedded server (tp=1): fields, sampling, logprobs, stops, batching."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from conftest import call, client_for, reference_greedy, run, scheduler_stats_when
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollfleet.engine.runtime.finishing import TEXTS_THREAD_TOKENS
from rollfleet.engine.sequences.texts_ahead import AHEAD_TOKENS

GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(qwen3_server):
    """conftest's plain qwen3 server, shared with the other engine modules (reset for each)."""
    return qwen3_server


def test_single_text_prompt_returns_one_object_with_meta_info(server):
    out = call(server, "generate", text="what is 12", sampling_params=GREEDY)
    assert isinstance(out, dict)
    assert len(out["output_ids"]) == 12
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 12}
    assert meta["weight_version"] == "default"
    assert meta["completion_tokens"] == 12 and meta["prompt_tokens"] > 0


def test_greedy_matches_transformers_and_logprobs_match_a_forward_pass(server, qwen3_dir):
    prompt = [5, 17, 42, 99, 7]
    out = call(server, "generate", input_ids=prompt, sampling_params=GREEDY, return_logprob=True)
    tokens, _ = reference_greedy(qwen3_dir, prompt, 12)
    assert out["output_ids"] == tokens
    # logprobs of the engine's own output, recomputed in one forward pass over prompt + output
    model = AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype=torch.float32).eval()
    full = torch.tensor([prompt + out["output_ids"]])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(full).logits[0].float(), -1)
    expected = [float(logprobs[len(prompt) - 1 + i, tok]) for i, tok in enumerate(out["output_ids"])]
    got = [entry[0] for entry in out["meta_info"]["output_token_logprobs"]]
    assert [entry[1] for entry in out["meta_info"]["output_token_logprobs"]] == out["output_ids"]
    assert max(abs(a - b) for a, b in zip(got, expected)) < 1e-4


def test_sampled_logprobs_match_a_forward_pass_in_a_padded_batch(server, qwen3_dir):
    prompts = [[5, 6], [7, 8, 9, 10, 11, 12, 13], [14]]
    outs = call(
        server,
        "generate",
        input_ids=prompts,
        return_logprob=True,
        sampling_params={"max_new_tokens": 10, "temperature": 1.0, "sampling_seed": 11, "ignore_eos": True},
    )
    model = AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype=torch.float32).eval()
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            logprobs = torch.log_softmax(model(torch.tensor([prompt + out["output_ids"]])).logits[0].float(), -1)
        expected = [float(logprobs[len(prompt) - 1 + i, t]) for i, t in enumerate(out["output_ids"])]
        got = [e[0] for e in out["meta_info"]["output_token_logprobs"]]
        assert max(abs(a - b) for a, b in zip(got, expected)) < 1e-4


def test_logprob_values_are_the_triples_values_as_one_list(server):
    """return_logprob_values (the embedded engine's, for rollfleet's own driver): the same logprobs as
    SGLang's triples, one list per sample, in a seeded batch with n and a stream; with
    return_text_in_logprobs (texts it cannot carry) a 400 naming both fields."""
    sampling = {"max_new_tokens": 9, "temperature": 1.0, "sampling_seed": 5, "ignore_eos": True, "n": 2}
    prompts = [[5, 6, 7], [8, 9]]
    triples = call(server, "generate", input_ids=prompts, sampling_params=sampling, return_logprob=True)
    values = call(
        server, "generate", input_ids=prompts, sampling_params=sampling, return_logprob=True, return_logprob_values=True
    )
    assert [o["output_ids"] for o in values] == [o["output_ids"] for o in triples]
    for got, want in zip(values, triples):
        meta = got["meta_info"]
        assert "output_token_logprobs" not in meta and meta["output_token_logprobs_length"] == 9
        assert meta["output_token_logprob_values"] == [e[0] for e in want["meta_info"]["output_token_logprobs"]]
    stream = run(
        _events(
            server,
            input_ids=prompts[0],
            sampling_params={**sampling, "n": 1},
            return_logprob=True,
            return_logprob_values=True,
        )
    )
    assert (
        stream[-1]["meta_info"]["output_token_logprob_values"] == values[0]["meta_info"]["output_token_logprob_values"]
    )
    with pytest.raises(Exception) as err:
        call(
            server,
            "generate",
            input_ids=prompts[0],
            sampling_params=GREEDY,
            return_logprob=True,
            return_logprob_values=True,
            return_text_in_logprobs=True,
        )
    assert err.value.status_code == 400 and "return_text_in_logprobs" in err.value.message


async def _events(server, **fields) -> list[dict]:
    async with client_for(server) as client:
        return [event async for event in client.generate_stream(**fields)]


def test_batch_with_n_groups_results_by_prompt(server):
    outs = call(
        server,
        "generate",
        text=["alpha", "beta"],
        sampling_params={"max_new_tokens": 6, "n": 3, "sampling_seed": 1, "ignore_eos": True},
    )
    assert len(outs) == 6
    assert [o["meta_info"]["prompt_tokens"] for o in outs[:3]] == [outs[0]["meta_info"]["prompt_tokens"]] * 3
    rids = [o["meta_info"]["id"] for o in outs]
    assert len(set(rids)) == 6
    assert rids[0].rsplit("-", 1)[0] == rids[2].rsplit("-", 1)[0] != rids[3].rsplit("-", 1)[0]
    # the n samples of one prompt differ from each other
    assert len({tuple(o["output_ids"]) for o in outs[:3]}) > 1


def test_same_seed_same_tokens_other_seed_other_tokens(server):
    params = {"max_new_tokens": 16, "temperature": 1.0, "sampling_seed": 7, "ignore_eos": True}
    first = call(server, "generate", input_ids=[3, 4, 5], sampling_params=params)
    again = call(server, "generate", input_ids=[3, 4, 5], sampling_params=params)
    other = call(server, "generate", input_ids=[3, 4, 5], sampling_params={**params, "sampling_seed": 8})
    assert first["output_ids"] == again["output_ids"]
    assert first["output_ids"] != other["output_ids"]


def test_a_seeded_request_draws_the_same_tokens_whatever_shares_its_batch(server):
    """The same seeded request (n=4) alone, inside one batch request among other prompts of other
    lengths and seeds, and among concurrent requests: the same tokens. Its logprobs agree to float
    rounding only: this server runs two threads, with which CPU attention and products of 5-7 or 9-11
    rows round with the batch (about 5e-7 apart here; a fleet's engines run one, kv/paged.py), which
    can flip a draw only where two tokens' noisy scores are that close."""
    params = {"max_new_tokens": 24, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 12345, "n": 4}
    mine, others = [5, 17, 42, 99, 7], [[i + 1] * (3 + 5 * i) for i in range(10)]
    theirs = [{**params, "sampling_seed": 1000 + i} for i in range(10)]

    async def go():
        async with client_for(server) as client:
            alone = await client.generate(input_ids=mine, sampling_params=params, return_logprob=True)
            batch = await client.generate(
                input_ids=others[:5] + [mine] + others[5:],
                sampling_params=theirs[:5] + [params] + theirs[5:],
                return_logprob=True,
            )
            calls = [
                client.generate(input_ids=o, sampling_params=p, return_logprob=True) for o, p in zip(others, theirs)
            ]
            calls.insert(3, client.generate(input_ids=mine, sampling_params=params, return_logprob=True))
            return alone, batch[20:24], (await asyncio.gather(*calls))[3]

    alone, in_batch, concurrent = run(go())
    for answers in (in_batch, concurrent):
        assert [a["output_ids"] for a in answers] == [a["output_ids"] for a in alone]
        for a, b in zip(answers, alone):
            got, want = ([e[0] for e in x["meta_info"]["output_token_logprobs"]] for x in (a, b))
            assert max(abs(g - w) for g, w in zip(got, want)) < 1e-5
    assert len({tuple(a["output_ids"]) for a in alone}) == 4  # the n samples differ


def test_top_k_one_equals_greedy(server):
    greedy = call(server, "generate", input_ids=[9, 9, 9], sampling_params=GREEDY)
    top1 = call(server, "generate", input_ids=[9, 9, 9], sampling_params={**GREEDY, "temperature": 1.0, "top_k": 1})
    assert greedy["output_ids"] == top1["output_ids"]


def test_stop_token_ids_and_stop_strings(server):
    base = call(server, "generate", input_ids=[1, 2, 3], sampling_params=GREEDY)
    stop_at = base["output_ids"][3]
    first = base["output_ids"].index(stop_at)
    out = call(server, "generate", input_ids=[1, 2, 3], sampling_params={**GREEDY, "stop_token_ids": [stop_at]})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_at}
    assert out["output_ids"] == base["output_ids"][: first + 1]
    text = base["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop, "the greedy text is too short to pick a stop string"
    out = call(server, "generate", input_ids=[1, 2, 3], sampling_params={**GREEDY, "stop": [stop]})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert stop not in out["text"] and text.startswith(out["text"])


def test_eos_stops_unless_ignore_eos(server):
    """Seed-sample until some output hits EOS (id 0), then check ignore_eos runs past it. The seeds go
    25 to a batch (one batch decodes about as fast as one request; a seeded sample draws the same
    tokens whatever shares its batch)."""
    for first in range(0, 200, 25):
        batch = [{"max_new_tokens": 64, "temperature": 1.0, "sampling_seed": seed} for seed in range(first, first + 25)]
        outs = call(server, "generate", input_ids=[[1]] * len(batch), sampling_params=batch)
        stopped = [(p, o) for p, o in zip(batch, outs) if o["meta_info"]["finish_reason"]["type"] == "stop"]
        if stopped:
            params, out = stopped[0]
            assert out["output_ids"][-1] == 0 and out["meta_info"]["finish_reason"]["matched"] == 0
            longer = call(server, "generate", input_ids=[1], sampling_params={**params, "ignore_eos": True})
            assert len(longer["output_ids"]) == 64
            assert longer["output_ids"][: len(out["output_ids"])] == out["output_ids"]
            return
    pytest.fail("no sample hit EOS in 200 seeds")


def test_zero_max_new_tokens_returns_at_once(server):
    out = call(server, "generate", input_ids=[1, 2], sampling_params={"max_new_tokens": 0})
    assert out["output_ids"] == [] and out["meta_info"]["finish_reason"]["type"] == "length"


def test_concurrent_requests_share_one_batch(server):
    async def go():
        async with client_for(server) as client:
            await client.pause_generation("in_place")  # hold them so they queue together
            tasks = [
                asyncio.create_task(client.generate(input_ids=[i + 1, 2], sampling_params=GREEDY)) for i in range(8)
            ]
            queued = await scheduler_stats_when(client, lambda s: s["waiting_requests"] == 8)
            before = queued["batches"]
            await client.continue_generation()
            outs = await asyncio.gather(*tasks)
            stats = (await client.get_server_info())["scheduler_stats"]
            return before, stats, outs

    before, stats, outs = run(go())
    assert all(len(o["output_ids"]) == 12 for o in outs)
    assert stats["batches"] == before + 1 and stats["largest_batch"] >= 8


def test_a_step_moves_the_sampled_ids_and_asked_logprobs_to_the_host_never_the_logits(server):
    """The logits of a step stay on the model's device: per sampled token, an int64 id and a float32
    logprob cross (the engine's `host_bytes`), plus the top-k asked for; never a row of the vocabulary."""

    def stats():
        return call(server, "get_server_info")["scheduler_stats"]

    before = stats()
    sampling = {"max_new_tokens": 16, "temperature": 1.0, "n": 4, "ignore_eos": True}
    call(server, "generate", input_ids=[[5, 6, 7], [8, 9]], sampling_params=sampling, return_logprob=True)
    middle = stats()
    tokens = middle["generated_tokens"] - before["generated_tokens"]
    assert tokens == 2 * 4 * 16
    assert middle["host_bytes"] - before["host_bytes"] == tokens * (8 + 4)
    call(server, "generate", input_ids=[5, 6, 7], sampling_params=sampling, return_logprob=True, top_logprobs_num=3)
    after = stats()
    assert after["host_bytes"] - middle["host_bytes"] == 4 * 16 * (8 + 4 + 3 * (4 + 8))


def test_a_wave_ending_at_once_gets_its_texts_from_the_texts_thread_and_the_clock_orders_its_end(server, qwen3_dir):
    """A GRPO wave: TEXTS_THREAD_TOKENS finished tokens at one step, decoded on the texts thread (in
    TEXTS_PARTS parts) while the engine thread retires and answers them: each text is the tokenizer's
    decode of its output ids (SGLang's skip_special_tokens default). The scheduler's clock
    (time.monotonic, the bench's split of a pass) reads, within the call: first step, last step's end,
    retired, decoded, answered, in that order."""
    sampling = {"max_new_tokens": 128, "temperature": 1.0, "n": 16, "ignore_eos": True}
    began = time.monotonic()
    outs = call(server, "generate", input_ids=[[5, 6, 7], [8, 9], [10, 11, 12], [13]], sampling_params=sampling)
    ended = time.monotonic()
    assert sum(len(o["output_ids"]) for o in outs) == 4 * 16 * 128 == TEXTS_THREAD_TOKENS
    tokenizer = AutoTokenizer.from_pretrained(qwen3_dir)
    assert [o["text"] for o in outs] == [tokenizer.decode(o["output_ids"], skip_special_tokens=True) for o in outs]
    stats = call(server, "get_server_info")["scheduler_stats"]
    order = ["batch_began_at", "steps_ended_at", "retired_at", "decoded_at", "answered_at"]
    assert began < stats[order[0]] and stats[order[-1]] < ended
    assert [stats[key] for key in order] == sorted(stats[key] for key in order)


def test_a_long_waves_texts_decoded_ahead_in_pieces_are_the_decodes_of_their_ids(server, qwen3_dir):
    """64 samples of 256 tokens: every AHEAD_TOKENS new tokens the running samples' texts are decoded
    ahead in pieces (sequences/texts_ahead.py); each text is still the tokenizer's decode of its ids,
    whose random draws cut UTF-8 sequences between the byte-level tokens."""
    before = call(server, "get_server_info")["scheduler_stats"]["texts_ahead_pieces"]
    sampling = {"max_new_tokens": 256, "temperature": 1.0, "n": 16, "ignore_eos": True}
    outs = call(server, "generate", input_ids=[[5, 6, 7], [8, 9], [10, 11, 12], [13]], sampling_params=sampling)
    assert sum(len(o["output_ids"]) for o in outs) == 64 * 256 >= 2 * AHEAD_TOKENS
    tokenizer = AutoTokenizer.from_pretrained(qwen3_dir)
    assert [o["text"] for o in outs] == [tokenizer.decode(o["output_ids"], skip_special_tokens=True) for o in outs]
    assert call(server, "get_server_info")["scheduler_stats"]["texts_ahead_pieces"] > before
