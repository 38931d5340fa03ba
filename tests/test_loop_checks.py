"""The loop's per-step checks are code, not asserts: a stale, lost or duplicated sample raises a
named error (these hold under `python -O` too)."""

from __future__ import annotations

import pytest

from rollfleet.sample import Sample
from rollfleet.train.invariants import LostOrDuplicatedSamples, StaleSamples, check_samples


def _samples(pairs, version="3"):
    return [Sample(p, k, [1, 2], weight_version=version, engine_id=p % 2) for p, k in pairs]


GOOD = [(p, k) for p in range(3) for k in range(2)]


def test_a_whole_step_at_its_version_passes():
    check_samples(_samples(GOOD), num_prompts=3, n=2, version="3")


def test_a_sample_from_another_version_is_named():
    samples = _samples(GOOD)
    samples[4].weight_version = "2"
    with pytest.raises(StaleSamples, match=r"1 samples are not from weight version '3'.*\(2, 0, '2'\)"):
        check_samples(samples, num_prompts=3, n=2, version="3")


@pytest.mark.parametrize(
    "pairs, words",
    [
        (GOOD[:-1], r"missing: \[\(2, 1\)\] \(1\)"),
        (GOOD + [(1, 0)], r"duplicated or unknown: \[\(1, 0\)\] \(1\)"),
        (GOOD[:-1] + [(0, 0)], r"missing: \[\(2, 1\)\].*duplicated or unknown: \[\(0, 0\)\]"),
        (GOOD + [(3, 0)], r"duplicated or unknown: \[\(3, 0\)\]"),
    ],
)
def test_a_lost_or_duplicated_sample_is_named(pairs, words):
    with pytest.raises(LostOrDuplicatedSamples, match=words):
        check_samples(_samples(pairs), num_prompts=3, n=2, version="3")
