"""The pieces of asynchronous GRPO that are pure logic: the staleness bound (how far ahead the producer
may generate, the oldest version of a sample, the per-step check), the prompt cursor that keeps
prompts from being lost or used twice, the gate between generate calls and pushes, and the config
that refuses asynchronous steps on shared GPUs."""

from __future__ import annotations

import threading

import pytest
from waits import wait_until

from rollfleet.config import ConfigError, load_config
from rollfleet.sample import Sample
from rollfleet.train.invariants import (
    LostOrDuplicatedSamples,
    StaleSamples,
    check_staleness,
    oldest_version,
    producer_room,
    sample_version,
)
from rollfleet.train.prompt_cursor import PromptCursor
from rollfleet.train.sample_stream import GenerationGate


@pytest.mark.parametrize(
    "version, next_step, k, queued, room",
    [
        (0, 0, 0, 0, 4),  # synchronous: the step's groups once its version is pushed
        (0, 1, 0, 0, 0),  # step 0 took its groups: nothing until version 1 is pushed
        (0, 0, 1, 0, 8),  # k = 1: steps 0 and 1 may come from version 0
        (0, 1, 1, 4, 0),  # step 1's groups are queued: wait for version 1
        (1, 1, 1, 4, 4),  # version 1 pushed: step 2's groups may start
        (3, 3, 2, 5, 7),  # k = 2: steps 3, 4, 5 from version 3, 5 already queued
        (2, 5, 1, 0, 0),  # the trainer is ahead of the weights (cannot happen): no room, not negative
    ],
)
def test_producer_room_keeps_every_group_within_k_versions(version, next_step, k, queued, room):
    assert producer_room(version, next_step, k, 4, queued) == room


def test_producer_room_never_lets_a_group_be_used_past_version_plus_k():
    """At any (version, next step, queued), each group the room allows is used at step
    next_step + (its place in the queue) // P, which never exceeds version + k; one more would."""
    per_step = 3
    for k in range(4):
        for version in range(5):
            for next_step in range(version + k + 2):
                for queued in range(0, 20):
                    room = producer_room(version, next_step, k, per_step, queued)
                    for place in range(queued, queued + room):
                        assert next_step + place // per_step <= version + k
                    # and it is the most: one more group (after the queue) would be used too late
                    assert next_step + max(queued, queued + room) // per_step > version + k


def test_oldest_version_reads_spans_when_the_weights_changed_mid_request():
    assert oldest_version("7") == 7
    # SGLang: weight_version names the version that finished the request; the spans list every one
    spans = [{"version": "5", "start": 0, "end": 3}, {"version": "6", "start": 3, "end": 9}]
    assert oldest_version("6", spans) == 5
    assert oldest_version("6", []) == 6  # an empty span list: the one version
    with pytest.raises(StaleSamples, match=r"weight version 'default' is not a step number"):
        oldest_version("default")
    sample = Sample(0, 0, [1], weight_version="4")
    assert sample_version(sample) == 4
    sample.weight_versions = [{"version": "2", "start": 0, "end": 1}, {"version": "4", "start": 1, "end": 2}]
    assert sample_version(sample) == 2


def test_check_staleness_holds_the_bound_and_names_what_breaks_it():
    samples = [Sample(p, 0, [1], weight_version=v, engine_id=p % 2) for p, v in enumerate(["5", "4", "5"])]
    assert check_staleness(samples, step=5, max_staleness=1) == [0, 1, 0]
    with pytest.raises(StaleSamples, match=r"1 samples at step 6 .* versions 5\.\.6 .*max_staleness=1.*\(1, 1, '4'\)"):
        check_staleness(samples, step=6, max_staleness=1)
    with pytest.raises(StaleSamples, match=r"2 samples at step 4"):  # versions the trainer has not pushed yet
        check_staleness(samples, step=4, max_staleness=3)
    spanning = Sample(0, 0, [1], weight_version="5")
    spanning.weight_versions = [{"version": "3", "start": 0, "end": 2}, {"version": "5", "start": 2, "end": 4}]
    with pytest.raises(StaleSamples, match=r"versions 4\.\.5"):  # its oldest token is what counts
        check_staleness([spanning], step=5, max_staleness=1)


def test_prompt_cursor_hands_out_each_position_once_and_survives_a_checkpoint():
    cursor = PromptCursor()
    assert cursor.hand_out(3) == [0, 1, 2]
    cursor.give_back(1)  # dropped as too stale: handed out again before anything new
    assert cursor.hand_out(2) == [1, 3]
    for position in (0, 3, 1):
        cursor.consume(position)
    assert cursor.state() == {"consumed_below": 2, "consumed": [3]}  # 2 was handed out, never used
    with pytest.raises(LostOrDuplicatedSamples, match="prompt position 3 would be used twice"):
        cursor.consume(3)
    resumed = PromptCursor.from_state(cursor.state(), step=9, prompts_per_step=4)
    assert resumed.hand_out(3) == [2, 4, 5]  # the unused one again, the used ones never
    assert PromptCursor.from_state(None, step=3, prompts_per_step=4).hand_out(1) == [12]  # a synchronous state


def test_a_push_waits_for_the_generate_call_under_way_and_holds_new_ones():
    gate, order = GenerationGate(), []
    release = {"a": threading.Event(), "b": threading.Event(), "push": threading.Event()}
    release["b"].set()

    def generate(name: str):
        with gate.generating():
            order.append(f"{name} start")
            release[name].wait()
            order.append(f"{name} end")

    def push():
        with gate.pushing():
            order.append("push start")
            release["push"].wait()
            order.append("push end")

    first, pusher, second = (threading.Thread(target=t) for t in (lambda: generate("a"), push, lambda: generate("b")))
    first.start()
    wait_until(lambda: gate.state["calls"] == 1, what="generate a under way")
    pusher.start()
    wait_until(lambda: gate.state["pushes"] == 1, what="the push waiting", alive=pusher.is_alive)
    second.start()
    wait_until(lambda: gate.state["held_calls"] == 1, what="generate b held", alive=second.is_alive)
    assert order == ["a start"]  # the push waits for "a", and "b" waits for the push
    release["a"].set()
    wait_until(lambda: "push start" in order, what="the push running", alive=pusher.is_alive)
    assert gate.state == {"calls": 0, "held_calls": 1, "pushes": 1}, order  # "b" still held by the push
    release["push"].set()
    for thread in (first, pusher, second):
        thread.join()
    assert order == ["a start", "a end", "push start", "push end", "b start", "b end"]


def test_colocated_runs_refuse_asynchronous_steps_with_the_reason(tmp_path):
    base = [f"rollout.model_path={tmp_path}", "rollout.placement=colocated"]
    with pytest.raises(ConfigError, match=r"grpo.max_staleness=1: .*share each GPU.*fix: set grpo.max_staleness=0"):
        load_config(None, [*base, "grpo.max_staleness=1"])
    assert load_config(None, [*base, "grpo.dynamic_sampling=true"]).grpo.max_staleness == 0
    assert load_config(None, [f"rollout.model_path={tmp_path}", "grpo.max_staleness=2"]).grpo.max_staleness == 2


def test_the_step_benchmark_runs_each_staleness_and_sets_async_steps_against_the_overlap_bound():
    from rollfleet.bench.grpo_step import async_ratios, planned_runs

    assert planned_runs("colocated,disaggregated", "0,1,2") == {
        "colocated": ("colocated", 0),  # k >= 1 is refused when the GPUs are shared
        "disaggregated": ("disaggregated", 0),
        "disaggregated-k1": ("disaggregated", 1),
        "disaggregated-k2": ("disaggregated", 2),
    }
    sync = {"generate": 2.4, "train": 0.2, "sync": 0.1, "total": 2.8}
    ratios = async_ratios({"disaggregated": sync, "disaggregated-k1": {"train": 0.2, "sync": 0.1, "total": 2.64}})
    assert ratios["disaggregated-k1"]["bound_s"] == 2.4 and ratios["disaggregated-k1"]["of"] == "disaggregated"
    assert ratios["disaggregated-k1"]["ratio"] == pytest.approx(1.1)
    assert ratios["disaggregated-k1"]["speedup_vs_sync"] == pytest.approx(2.8 / 2.64)
    alone = async_ratios({"disaggregated-k2": {"generate_busy_seconds": 1.0, "train": 1.5, "sync": 0.5, "total": 3.0}})
    assert alone["disaggregated-k2"]["bound_s"] == 2.0 and alone["disaggregated-k2"]["ratio"] == 1.5
