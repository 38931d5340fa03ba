"""The engines' sampling seeds (rollfleet.fleet.sampling_seeds): a pure function of the run's seed and
the request's place in the run, and the two request forms (one seed per request, one per sample).
SGLang's own normalisation of both forms: tests/test_sglang_contract.py; seeded runs that repeat:
tests/test_grpo_loop.py; seeds across engines and retries: tests/test_fleet.py."""

from __future__ import annotations

import copy

from hypothesis import given
from hypothesis import strategies as st

from rollfleet.fleet.sampling_seeds import derive_seed, seeded_payload
from rollfleet.train.sample_stream import prompt_seeds


def test_a_seed_is_fixed_by_its_parts_alone():
    # pinned: a change here changes every seeded run's samples (the records' runs could not be repeated)
    assert derive_seed(0, 0) == 1350176041220068806
    assert derive_seed(0, 0) == derive_seed(0, 0)
    assert derive_seed(0, 1) != derive_seed(1, 0)  # the order of the parts counts
    assert derive_seed(0, 1) != derive_seed(0, 1, 0)  # and their number


@given(st.lists(st.integers(-(2**70), 2**70), min_size=1, max_size=4))
def test_seeds_are_inside_sglangs_range_and_nonnegative(parts):
    assert 0 <= derive_seed(*parts) < 2**63


def test_prompts_of_a_stream_get_distinct_seeds_and_an_unseeded_run_none():
    seeds = prompt_seeds(0, range(4096))
    assert len(set(seeds)) == 4096
    assert prompt_seeds(0, [7, 3]) == [seeds[7], seeds[3]]  # a prompt's seed is its position's
    assert prompt_seeds(1, [7]) != [seeds[7]]
    assert prompt_seeds(None, range(3)) is None


def test_one_seed_per_request_or_one_per_sample():
    payload = {"input_ids": [4, 5], "sampling_params": {"n": 3, "temperature": 1.0}, "lora_path": "a", "x": 1}
    before = copy.deepcopy(payload)
    plain = seeded_payload(payload, 99, each_sample=False)
    assert plain == {**payload, "sampling_params": {"n": 3, "temperature": 1.0, "sampling_seed": 99}}
    each = seeded_payload(payload, 99, each_sample=True)
    assert each["input_ids"] == [[4, 5]] * 3 and (each["lora_path"], each["x"]) == ("a", 1)
    assert each["sampling_params"] == [
        {"n": 1, "temperature": 1.0, "sampling_seed": derive_seed(99, k)} for k in range(3)
    ]
    assert payload == before  # the caller's payload is left as it was
