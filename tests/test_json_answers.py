"""Answers as JSON both ways: the server writes them with orjson (as SGLang's does) and the client reads
them with it, and what orjson refuses still gets an answer instead of an HTTP 500."""

from __future__ import annotations

import json
import math

from hypothesis import given
from hypothesis import strategies as st

from rollfleet.engine.http.service import dumps
from rollfleet.wire.client import parse_answer

ANSWERS = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.floats() | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20,
)


def _finite(value):
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, list):
        return [_finite(v) for v in value]
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    return value


@given(ANSWERS)
def test_an_answer_reads_back_as_written_with_non_finite_floats_as_null(value):
    body = dumps(value)
    assert json.loads(body) == _finite(value)  # standard JSON: Python's parser in strict use agrees
    assert parse_answer(body) == _finite(value)


def test_what_orjson_refuses_is_written_the_slow_way():
    big = 2**70  # past 64 bits: orjson refuses it, JSON has it
    assert json.loads(dumps({"n": big, "x": float("nan")})) == {"n": big, "x": None}
    assert json.loads(dumps({1: "a"})) == {"1": "a"}  # a non-string key, as json.dumps writes it
    assert json.loads(dumps({"t": "a\ud800b", "n": big})) == {"t": "a\ud800b", "n": big}  # a lone surrogate


def test_the_client_reads_non_standard_nan_and_plain_text():
    assert math.isnan(parse_answer(b'{"x": NaN}')["x"])  # Python's parser
    assert parse_answer(b"not json") == "not json"
    assert parse_answer(b"") is None
