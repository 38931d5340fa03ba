"""Streamed text (engine/http/stream_text.py, streaming.progress): every chunk's text is a prefix of the
finished answer's and the chunks add up to it exactly (stop strings trimmed or kept, special tokens
skipped or kept, characters whose bytes come in several tokens), and a chunk decodes a bounded
window of tokens however long the output is. First with the byte-level tokenizer of the tiny
models fed token by token as the engine does, then on a real server's streams (/generate,
/v1/completions), sampled at temperature 1 so that outputs hold characters split over tokens."""

from __future__ import annotations

import json
import random

import httpx
from hypothesis import given, settings
from hypothesis import strategies as st
from test_stop_strings import ANY_IDS, TEXT, TEXTS, TOKENIZER, CountingTokenizer, encode, params

from rollfleet.engine.http.stream_text import HELD_TOKENS, SETTLED_TOKENS, StreamText
from rollfleet.engine.sequences.next_token import StopRules
from rollfleet.engine.sequences.sequence import Sequence
from rollfleet.wire.protocol import FinishReason

REPLACEMENT_IDS = [i for i in range(len(TOKENIZER)) if TOKENIZER.decode([i]) == "\ufffd"]  # bytes of no character


def stream_as_the_engine(ids: list[int], stop, tokenizer=TOKENIZER, **fields):
    """Feed `ids` as the engine appends sampled tokens, a StreamText taking every unfinished step:
    (the texts it showed after each step, the new texts, the finished answer's text)."""
    seq = Sequence("r", [1], params(stop, **fields), None, return_logprob=False)
    rules = StopRules(frozenset(), context_length=100_000, tokenizer=TOKENIZER)
    text = StreamText(tokenizer, seq.params)
    shown, new = [], []
    for token in ids:
        seq.output_ids.append(token)
        seq.finish = rules.finish_reason(seq, token)
        if seq.finish is not None:
            break
        new.append(text.update(seq.output_ids))
        shown.append(text.text)
    if seq.finish is None:  # the engine ends it at max_new_tokens
        seq.finish = FinishReason(type="length", length=len(ids))
    final = seq.text if isinstance(seq.finish.matched, str) else seq.finished_text(TOKENIZER)
    return shown, new, final


def check_adds_up(shown: list[str], new: list[str], final: str) -> None:
    assert all(final.startswith(text) for text in shown)
    assert "".join(new) + final[len(shown[-1]) if shown else 0 :] == final


@settings(max_examples=300, deadline=None)
@given(ids=st.one_of(TEXTS, ANY_IDS).filter(bool), data=st.data())
def test_chunks_are_prefixes_of_the_answer_and_add_up_to_it(ids, data):
    skip, keep = data.draw(st.booleans()), data.draw(st.booleans())
    full = TOKENIZER.decode(ids, skip_special_tokens=skip)
    cuts = st.tuples(st.integers(0, len(full)), st.integers(1, 6)).map(lambda c: full[c[0] : c[0] + c[1]])
    stops = data.draw(st.lists(st.one_of(cuts, st.text(alphabet="ab é€😀", min_size=1, max_size=4)), max_size=3))
    fields = {"skip_special_tokens": skip, "no_stop_trim": keep}
    check_adds_up(*stream_as_the_engine(ids, [s for s in stops if s] or None, **fields))


def test_a_stop_string_over_two_tokens_is_not_shown_before_it_is_cut():
    ids = encode(TEXT)
    pieces = [TOKENIZER.decode([token]) for token in ids]
    at = next(i for i in range(1, len(ids)) if len(pieces[i - 1]) > 1 and len(pieces[i]) > 1)
    stop = pieces[at - 1][-1] + pieces[at][0]
    shown, new, final = stream_as_the_engine(ids, stop)
    assert final == "".join(pieces[:at])[:-1] and shown[-1] == final  # its first character was held back
    check_adds_up(shown, new, final)
    shown, new, kept = stream_as_the_engine(ids, stop, no_stop_trim=True)
    assert kept == final + stop and shown[-1] == "".join(pieces[:at])  # nothing to hold back when it is kept


def test_a_character_split_over_tokens_is_shown_once_complete():
    ids = encode("a😀b")  # one byte a token: the emoji takes four
    shown, _, _ = stream_as_the_engine(ids, None)
    assert shown == ["a", "a", "a", "a", "a😀", "a😀b"]


def test_the_decoding_per_chunk_is_bounded_however_long_the_output():
    text = " ".join(["the quick brown fox jumps over é€😀 the lazy dog"] * 30)
    rng = random.Random(0)
    noise = [rng.randrange(len(TOKENIZER)) for _ in range(300)]  # special tokens, broken characters
    ids = encode(text) + REPLACEMENT_IDS[:1] * 100 + noise + encode(text)  # a long run of stray bytes too
    assert len(ids) > 1500 and REPLACEMENT_IDS
    for skip in (True, False):
        counting = CountingTokenizer(TOKENIZER)
        stream = StreamText(counting, params(["zzz", "jumps!"], skip_special_tokens=skip))
        per_chunk, new = [], []
        for count in range(1, len(ids) + 1):
            counting.decoded = 0
            new.append(stream.update(ids[:count]))
            per_chunk.append(counting.decoded)
        assert max(per_chunk) <= 6 * (HELD_TOKENS + SETTLED_TOKENS), max(per_chunk)
        final = TOKENIZER.decode(ids, skip_special_tokens=skip)
        assert final.startswith(stream.text) and "".join(new) == stream.text
        assert len(stream.text) > len(final) - 20  # all but the last few characters were shown


# a real server's streams

PROMPT = [5, 17, 42, 99, 7, 150, 23]
SAMPLED = {"temperature": 1.0, "max_new_tokens": 40, "ignore_eos": True}


def post(server, route: str, body: dict) -> dict:
    response = httpx.post(server.url + route, json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def stream(server, route: str, body: dict) -> list[dict]:
    response = httpx.post(server.url + route, json={**body, "stream": True}, timeout=60)
    assert response.status_code == 200, response.text
    chunks = response.text.split("\n\n")
    assert chunks[-2:] == ["data: [DONE]", ""]
    return [json.loads(chunk.removeprefix("data: ")) for chunk in chunks[:-2]]


def stop_over_a_boundary(ids: list[int], skip: bool) -> str | None:
    """Two characters of the text of `ids`, on both sides of a token boundary, found first there."""
    text = TOKENIZER.decode(ids, skip_special_tokens=skip)
    for count in range(2, len(ids)):
        end = len(TOKENIZER.decode(ids[:count], skip_special_tokens=skip))
        stop = text[end - 1 : end + 1]
        if len(stop) == 2 and "\ufffd" not in stop and text.index(stop) == end - 1:
            return stop
    return None


def splits_a_character(ids: list[int]) -> bool:
    return any(TOKENIZER.decode(ids[:count]).endswith("\ufffd") for count in range(1, len(ids)))


def streamed_cases(server):
    """(sampling params, the /generate answer) per seed, skip_special_tokens and stop: none, one over
    a token boundary (trimmed or kept)."""
    for seed in range(4):
        for skip in (True, False):
            sampled = {**SAMPLED, "sampling_seed": seed, "skip_special_tokens": skip}
            plain = post(server, "/generate", {"input_ids": PROMPT, "sampling_params": sampled})
            yield sampled, plain
            stop = stop_over_a_boundary(plain["output_ids"], skip)
            for keep in (False, True):
                stopped = {**sampled, "stop": stop, "no_stop_trim": keep}
                answer = post(server, "/generate", {"input_ids": PROMPT, "sampling_params": stopped})
                assert answer["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
                yield stopped, answer


def test_generate_stream_texts_are_prefixes_ending_in_the_answer(qwen3_server):
    split = False
    for sampled, answer in streamed_cases(qwen3_server):
        events = stream(qwen3_server, "/generate", {"input_ids": PROMPT, "sampling_params": sampled})
        assert events[-1]["text"] == answer["text"] and events[-1]["output_ids"] == answer["output_ids"]
        assert all(answer["text"].startswith(event["text"]) for event in events), sampled
        split |= splits_a_character(answer["output_ids"])
    assert split  # some output had a character whose bytes came in several tokens


def test_completion_stream_deltas_add_up_to_the_answer(qwen3_server):
    for sampled, _ in streamed_cases(qwen3_server):
        body = {
            "prompt": PROMPT,
            "max_tokens": sampled["max_new_tokens"],
            "temperature": 1.0,
            "ignore_eos": True,
            "seed": sampled["sampling_seed"],
            **{key: sampled[key] for key in ("skip_special_tokens", "stop", "no_stop_trim") if key in sampled},
        }
        answer = post(qwen3_server, "/v1/completions", body)["choices"][0]
        chunks = [c["choices"][0] for c in stream(qwen3_server, "/v1/completions", body) if c["choices"]]
        assert "".join(chunk["text"] for chunk in chunks) == answer["text"], body
        assert chunks[-1]["finish_reason"] == answer["finish_reason"]
