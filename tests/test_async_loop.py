"""Asynchronous GRPO end to end (real Ray, engine, FSDP2 trainer on gloo): with grpo.max_staleness=1 the
engine generates the next step's samples while the trainer trains, no step trains on a token older
than one version, dynamic sampling drops groups of equal rewards, and a resumed run neither loses nor
repeats a prompt (what was queued at the checkpoint is generated again, from the resumed weights), also
when it goes on synchronously."""

from __future__ import annotations

import pytest
from test_grpo_loop import run_config, train_rows

from rollfleet.data.prompts import PromptDataset
from rollfleet.data.synthetic import make_records
from rollfleet.rewards.basic import copy_digits

# one Ray (conftest's) for the module's runs: train() leaves running a Ray it did not start, which
# saves each run Ray's start and shutdown (seconds of CPU on this machine)
pytestmark = pytest.mark.usefixtures("local_ray")


def half_constant(text: str, answer: str) -> float:
    """The copy task's reward for odd answers; 0.5 whatever the text for even ones (a group of equal
    rewards: dynamic sampling must drop it)."""
    return 0.5 if int(answer) % 2 == 0 else copy_digits(text, answer)


def constant_answer(position: int) -> bool:
    """Whether the prompt at this stream position gets equal rewards (the run's dataset and seed)."""
    dataset = PromptDataset.from_records(make_records(32, num_digits=3, seed=0))
    return int(dataset.batch(position, 1, seed=0)[0].answer) % 2 == 0


def test_async_steps_hold_the_bound_drop_equal_groups_and_resume_without_losing_a_prompt(qwen3_dir, tmp_path):
    options = (
        "grpo.max_staleness=1",
        "grpo.dynamic_sampling=true",
        "grpo.dynamic_sampling_max_extra=2",
        "grpo.reward=test_async_loop:half_constant",
        "weight_sync.transport=tensor",
    )
    seen: dict[int, tuple[list, list]] = {}

    def observe(step, items, samples):
        seen[step] = (list(items), list(samples))

    first = train_rows(*run_config(qwen3_dir, tmp_path, "grpo.steps=3", *options), tmp_path, observe=observe)
    assert first[-1]["queued_groups"] > 0  # the producer ran ahead: these are lost with the process
    train_rows(*run_config(qwen3_dir, tmp_path, "grpo.steps=5", *options), tmp_path, resume=True, observe=observe)
    # the same run goes on synchronously (k = 0, no dynamic sampling) from the asynchronous state:
    # it takes the prompts the record says are unused, not the plain loop's positions 20..23
    resumed_synchronously = run_config(qwen3_dir, tmp_path, "grpo.steps=6", *options[3:])
    rows = train_rows(*resumed_synchronously, tmp_path, resume=True, observe=observe)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6] and sorted(seen) == [0, 1, 2, 3, 4, 5]
    assert rows[5]["staleness_max"] == 0 and not rows[5]["dropped_positions"]

    for step, (items, samples) in seen.items():  # what each step trained on, as the loop gave it
        versions = {int(s.weight_version) for s in samples}
        assert versions <= {step - 1, step}, (step, versions)  # never older than step - k
        assert [s.prompt_index for s in samples] == [p for p in range(4) for _ in range(4)]
        for s in samples:
            assert s.reward == half_constant(s.text, items[s.prompt_index].answer)
        if step == 5:  # the synchronous step drops no group: equal rewards are trained too
            continue
        if not rows[step]["dynamic_kept_uninformative"]:
            groups = [{s.reward for s in samples if s.prompt_index == p} for p in range(4)]
            assert all(len(g) > 1 for g in groups), (step, groups)
    assert all(r["staleness_max"] <= 1 for r in rows)
    assert any(r["staleness_max"] == 1 for r in first)  # the samples really were made ahead
    assert rows[3]["staleness_max"] == 0  # the first step after the resume: generated again, at version 3

    used = [p for r in rows for p in r["prompt_positions"] + r["dropped_positions"]]
    assert sorted(used) == list(range(len(used))), used  # none lost, none twice, across the restart
    dropped = [p for r in rows for p in r["dropped_positions"]]
    assert dropped and all(r["dynamic_dropped"] <= 2 for r in rows)
    for row in rows[:5]:  # with dynamic sampling, a prompt of equal rewards is trained only once the
        # step's extra budget is spent (the synchronous step 6 trains them all)
        trained_constant = [p for p in row["prompt_positions"] if constant_answer(p)]
        assert len(trained_constant) <= row["dynamic_kept_uninformative"], row["step"]
