"""What tools cost a rollout's wall clock, from the spans its episodes recorded (rollfleet.agents.figures),
and the training metrics line that names it."""

from __future__ import annotations

import pytest

from rollfleet.agents.figures import episode_figures, union_seconds, wall_figures
from rollfleet.sample import Sample
from rollfleet.train.metrics import _episodes_text


def episode(lifetime, generates, tools, reason="answered") -> Sample:
    s = Sample(0, 0, [1], output_ids=[2, 3], loss_mask=[1, 0], finish_reason={"type": reason})
    s.episode = {
        "lifetime": lifetime,
        "generate_spans": generates,
        "tool_spans": tools,
    }
    return s


def test_union_counts_overlaps_once():
    assert union_seconds([]) == 0.0
    assert union_seconds([[0, 2], [1, 3], [5, 6], [5.5, 5.7]]) == pytest.approx(4.0)
    assert union_seconds([[4, 7], [0, 10]]) == pytest.approx(10.0)


def test_tool_shares_of_the_wall_clock():
    # A: generate 0-2, tool 2-5, generate 5-6, tool 6-9 (lives 0-10); B: generate 1-3, tool 3-4, generate 4-7
    a = episode([0, 10], [[0, 2], [5, 6]], [[2, 5], [6, 9]])
    b = episode([1, 8], [[1, 3], [4, 7]], [[3, 4]])
    figures = wall_figures([a, b])
    assert figures["rollout_wall_seconds"] == pytest.approx(10.0)
    # a tool runs over 2-5 and 6-9; only tools (no generate in flight) over 3-4 and 7-9
    assert figures["tool_wall_share"] == pytest.approx(0.6)
    assert figures["tool_only_wall_share"] == pytest.approx(0.3)
    # beside the per-episode share: 7 tool seconds of 7 + 8 seconds of tools and generates
    assert episode_figures([a, b])["tool_wait_share"] == pytest.approx(7 / 15)


def test_the_wall_clock_is_the_time_an_episode_was_in_flight():
    """Two episodes of one step made apart (an asynchronous run's chunks): the gap counts for neither."""
    a = episode([0, 2], [[0, 1]], [[1, 2]])
    b = episode([10, 12], [[10, 11]], [[11, 12]])
    figures = wall_figures([a, b])
    assert figures["rollout_wall_seconds"] == pytest.approx(4.0)
    assert figures["tool_wall_share"] == pytest.approx(0.5) == figures["tool_only_wall_share"]


def test_the_metrics_line_names_both_shares_and_refused_episodes():
    a = episode([0, 10], [[0, 2], [5, 6]], [[2, 5], [6, 9]])
    b = episode([1, 8], [[1, 3], [4, 7]], [[3, 4]], reason="engine_rejected")
    text = _episodes_text({"episodes": episode_figures([a, b])})
    assert "of rollout wall time 60% with a tool running, 30% with only tools running" in text, text
    assert "1 refused by the engine" in text
