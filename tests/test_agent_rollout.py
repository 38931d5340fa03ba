"""Multi-turn episodes on a real Ray fleet of two embedded engines: one token list per episode that
is exactly the engines' turns and the environment's observations (nothing decoded and encoded again),
masks over the policy's tokens only, turns kept on their engine, an engine killed under a turn losing
nothing, tools that hang or fail ending only their episode; and a GRPO run over episodes."""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import threading
from pathlib import Path

import pytest
from agent_envs import Scripted, Troubled
from conftest import hold_with_requests, kill, pause_engine, run, serving_again
from transformers import AutoModelForCausalLM, AutoTokenizer
from waits import wait_until

from rollfleet.agents.rollout import AgentRollout, EngineRejectedAll
from rollfleet.config import load_config
from rollfleet.config.agent import AgentConfig
from rollfleet.data.prompts import PromptItem
from rollfleet.fleet.fleet import Fleet
from rollfleet.tiny_models import CHATML_TEMPLATE, make_tiny_model
from rollfleet.train.invariants import check_complete
from rollfleet.train.loop import train
from rollfleet.train.sample_stream import prompt_seeds
from rollfleet.wire.client import EngineClient

pytestmark = pytest.mark.usefixtures("local_ray")
SCRIPT = [
    ("messages", [{"role": "tool", "content": "579"}]),
    ("text", " then"),
    ("token_ids", [5, 6, 7]),
]


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("chat"), "qwen3", seed=0, chat_template=CHATML_TEMPLATE))


@pytest.fixture(scope="module")
def fleet(chat_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("agents")
    cfg = load_config(
        None,
        [
            f"rollout.model_path={chat_dir}",
            "rollout.use_gpu=true",
            "rollout.num_engines=2",
            "rollout.sampling.max_new_tokens=4",
            "rollout.sampling.ignore_eos=true",  # a held turn must not end by chance within its steps
            f"rollout.log_dir={out}/logs",
            "rollout.auto_restart=false",
            "rollout.recovery_wait_s=60",
            "weight_sync.transport=tensor",
        ],
    )
    fleet = Fleet.from_config(cfg)
    yield fleet
    fleet.shutdown()


@pytest.fixture
def serving(fleet, chat_dir):
    serving_again(fleet, AutoModelForCausalLM.from_pretrained(chat_dir))
    return fleet


def chatml(messages) -> str:
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)


def expected_observation(tokenizer, kind, value, turn_ids) -> list[int]:
    """The ids an observation must add, written out here from ChatML itself."""
    if kind == "token_ids":
        return list(value)
    if kind == "text":
        return tokenizer.encode(value, add_special_tokens=False)
    ids = tokenizer.encode("<|im_end|>\n" + chatml(value) + "<|im_start|>assistant\n", add_special_tokens=False)
    return ids[1:] if turn_ids[-1] == ids[0] else ids  # the model closed its turn itself


def expected_episode(tokenizer, env) -> tuple[list[int], list[int]]:
    """The token list and mask of `env`'s episode: each turn as the engine returned it, then the
    script's observation."""
    ids, mask = [], []
    for turn in env.turns:
        ids += turn.token_ids
        mask += [1] * len(turn.token_ids)
        if turn.index < len(env.script):
            observed = expected_observation(tokenizer, *env.script[turn.index], turn.token_ids)
            ids += observed
            mask += [0] * len(observed)
    return ids, mask


def test_episodes_keep_the_engines_tokens_and_mask_only_the_policys(serving, chat_dir):
    tokenizer = AutoTokenizer.from_pretrained(chat_dir)
    record: list = []
    rollout = AgentRollout(serving, Scripted, {"record": record, "script": SCRIPT}, AgentConfig(max_turns=6))
    items = [PromptItem(f"{a}+{a}", "", a) for a in (12, 345, 6)]
    samples = rollout.run(items, n=3)
    check_complete(samples, 3, 3)
    assert len(record) == 9 and all(len(env.turns) == 4 for env in record)
    assert sorted((s.prompt_ids, s.output_ids, s.loss_mask) for s in samples) == sorted(
        (
            tokenizer.encode(chatml([{"role": "user", "content": env.prompt}]) + "<|im_start|>assistant\n"),
            *expected_episode(tokenizer, env),
        )
        for env in record
    )
    for s in samples:
        assert s.turns == 4 and s.finish_reason["type"] == "scripted"
        assert all((lp < 0) if keep else (lp == 0.0) for lp, keep in zip(s.logprobs, s.loss_mask, strict=True))
        assert s.token_versions == [serving.version if keep else None for keep in s.loss_mask]
        assert len(set(s.episode["engine_ids"])) == 1  # every turn on the engine of the first one
        # the spans the wall-clock shares come from: generate, step, generate, ... within the episode's life
        spans = [x for pair in zip(s.episode["generate_spans"], s.episode["tool_spans"]) for x in pair]
        assert len(s.episode["generate_spans"]) == len(s.episode["tool_spans"]) == 4
        points = [s.episode["lifetime"][0], *(t for span in spans for t in span), s.episode["lifetime"][1]]
        assert points == sorted(points)
    assert {s.engine_id for s in samples} == {0, 1}
    # the engine scores the kept list as it sampled it: the same tokens, the same logprobs
    s = samples[0]

    async def score():
        async with EngineClient(serving.slots[s.engine_id].url) as client:
            payload = {"max_new_tokens": 1}
            return await client.generate(
                input_ids=s.prompt_ids + s.output_ids, sampling_params=payload, return_logprob=True, logprob_start_len=0
            )

    scored = run(score())["meta_info"]["input_token_logprobs"]
    assert len(scored) == len(s.prompt_ids) + len(s.output_ids), (len(scored), len(s.prompt_ids), len(s.output_ids))
    start = len(s.prompt_ids)
    for i, keep in enumerate(s.loss_mask):
        if keep:
            assert scored[start + i][0] == pytest.approx(s.logprobs[i], abs=1e-4)


def test_tools_that_hang_or_fail_and_the_limits_end_only_their_episode(serving):
    limits = AgentConfig(max_turns=3, max_total_tokens=100, tool_timeout_s=1.0, failed_reward=-1.0)
    rollout = AgentRollout(serving, Troubled, {}, limits)
    prompts = ["hang", "fail", "chatty", "long", "fine"]
    samples = rollout.run([PromptItem(p, "", i) for i, p in enumerate(prompts)], n=2)
    by_prompt = {prompts[s.prompt_index]: s for s in samples}
    assert {p: (s.finish_reason["type"], s.reward, s.turns) for p, s in by_prompt.items()} == {
        "hang": ("tool_timeout", -1.0, 1),
        "fail": ("tool_error", -1.0, 1),
        "chatty": ("max_turns", -1.0, 3),
        "long": ("max_tokens", -1.0, 1),
        "fine": ("fine", 1.0, 1),
    }
    assert "went away" in by_prompt["fail"].finish_reason["message"]
    chatty = by_prompt["chatty"]  # two observations between three turns; the last one is not appended
    more = len(serving.tokenizer.encode(" more", add_special_tokens=False))
    assert chatty.loss_mask == [1] * 4 + [0] * more + [1] * 4 + [0] * more + [1] * 4
    assert by_prompt["long"].loss_mask == [1] * 4  # the observation past the budget is not appended
    assert sum(s.finish_reason["type"] == "fine" for s in samples) == 2


def test_an_engine_refusing_a_turn_ends_only_that_episode(serving, caplog):
    """A turn the engine answers with a 4xx (past its context length, a token outside the vocabulary)
    ends its episode with the engine's status and message; the call's other episodes complete, the
    refused request goes to no other engine, and each refused episode is logged once."""
    limits = AgentConfig(max_turns=3, max_total_tokens=2048, failed_reward=-1.0)  # past the context: the engine's
    rollout = AgentRollout(serving, Troubled, {}, limits)
    prompts = ["past_context", "bad_token", "chatty", "fine"]
    retries = serving.router.retries
    with caplog.at_level(logging.WARNING, logger="rollfleet.agents"):
        samples = rollout.run([PromptItem(p, "", i) for i, p in enumerate(prompts)], n=2)
    check_complete(samples, 4, 2)
    ends = sorted((prompts[s.prompt_index], s.finish_reason["type"], s.reward, s.turns) for s in samples)
    assert ends == sorted(
        [(p, "engine_rejected", -1.0, 1) for p in ("past_context", "bad_token")] * 2
        + [("chatty", "max_turns", -1.0, 3)] * 2
        + [("fine", "fine", 1.0, 1)] * 2
    )
    for s in samples:
        if s.finish_reason["type"] == "engine_rejected":
            assert s.finish_reason["status"] == 400
            wanted = "context length is 512" if prompts[s.prompt_index] == "past_context" else "vocabulary"
            assert wanted in s.finish_reason["message"], s.finish_reason
            assert len(s.episode["generate_spans"]) == 2  # the refused turn was asked once
    refused = [r for r in caplog.records if "the engine refused turn" in r.getMessage()]
    assert len(refused) == 4, [r.getMessage() for r in refused]
    assert serving.router.retries == retries  # a 4xx is the request's: sent to no other engine
    assert all(slot.state.value == "ACTIVE" for slot in serving.slots)


def test_a_call_whose_every_episode_is_refused_raises_the_engines_message(serving):
    rollout = AgentRollout(serving, Troubled, {}, AgentConfig(max_total_tokens=2048))
    items = [PromptItem("past_context", "", 0), PromptItem("bad_token", "", 1)]
    with pytest.raises(
        EngineRejectedAll, match=r"every one of the call's 4 episodes.*HTTP 400: prompt 0 has \d+ tokens"
    ):
        rollout.run(items, n=2)


def test_engine_killed_under_a_turn_loses_and_doubles_nothing(serving, chat_dir):
    """Seeded: a turn sent again to the other engine carries its seed, so every episode is the one its
    seeds drew in a call before the kill."""
    tokenizer = AutoTokenizer.from_pretrained(chat_dir)
    record, gate, result = [], threading.Event(), {}
    script = [("text", " ok")]
    items, seeds = [PromptItem(f"q{i}", "", i) for i in range(4)], prompt_seeds(0, range(4))
    unheld = AgentRollout(serving, Scripted, {"record": [], "script": script}, AgentConfig())
    before = unheld.run(items, n=1, seeds=seeds)
    rollout = AgentRollout(serving, Scripted, {"record": record, "script": script, "gate": gate}, AgentConfig())
    worker = threading.Thread(target=lambda: result.update(samples=rollout.run(items, n=1, seeds=seeds)))
    worker.start()
    try:
        wait_until(lambda: len(record) == 4 and all(e.held for e in record), what="first turns", alive=worker.is_alive)
        victims = [env for env in record if env.turns[0].engine_id == 1]
        assert victims and len(victims) < 4
        pause_engine(serving, 1)  # the second turns of its episodes go back to it (it still serves) and wait
        gate.set()
        hold_with_requests(serving, 1, alive=worker.is_alive, steps=1)  # mid-turn: one token sampled
    finally:
        gate.set()
        kill(serving, 1)
        worker.join(120)
    samples = result["samples"]
    check_complete(samples, 4, 1)
    assert all(len(env.turns) == 2 for env in record)  # each environment saw each turn once: the completed one
    for s in samples:
        env = next(e for e in record if e.prompt == items[s.prompt_index].prompt)
        assert (s.output_ids, s.loss_mask) == expected_episode(tokenizer, env)
        assert len(s.output_ids) == 4 + len(tokenizer.encode(" ok")) + 4
        moved = env in victims  # the turn killed on engine 1 was sent again, from the same ids, to engine 0
        assert s.episode["engine_ids"] == ([1, 0] if moved else [0, 0])
    assert [s.output_ids for s in samples] == [s.output_ids for s in before]
    # the router marks it dead when its process is gone at the failed call; when the socket closed a
    # moment before the process was reaped, the fleet's death watch does, just after
    wait_until(lambda: serving.slots[1].state.value == "INACTIVE", what="engine 1 marked dead")


def train_episodes(chat_dir, tmp_path, overrides: list[str]) -> tuple[list[dict], dict]:
    """A real `train` run over episodes (2 samples a prompt, 3 new tokens a turn): its metrics rows
    and each step's samples."""
    temp = tempfile.mkdtemp(prefix="rf-ray-")
    common = [
        f"rollout.model_path={chat_dir}",
        "rollout.sampling.n=2",
        "rollout.sampling.max_new_tokens=3",
        f"rollout.log_dir={tmp_path}/logs",
        "weight_sync.transport=tensor",
        f"grpo.output_dir={tmp_path}",
        f"ray.temp_dir={temp}",
    ]
    steps = {}
    try:
        train(load_config(None, common + overrides), observe=lambda step, items, samples: steps.update({step: samples}))
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    return [json.loads(line) for line in (Path(tmp_path) / "metrics.jsonl").read_text().splitlines()], steps


def test_grpo_over_episodes_trains_on_the_policys_tokens_only(chat_dir, tmp_path):
    overrides = ["rollout.placement=colocated", "grpo.environment=agent_envs:Echo", "grpo.agent.max_turns=3"]
    rows, steps = train_episodes(
        chat_dir, tmp_path, overrides + ["grpo.steps=2", "grpo.prompts_per_step=2", "grpo.synthetic_prompts=8"]
    )
    assert [r["step"] for r in rows] == [1, 2]
    for step, row in enumerate(rows):
        samples = steps[step]
        assert all(s.turns == 2 and s.loss_mask.count(0) > 0 for s in samples)
        # the loss covered exactly the policy's tokens, scored by the trainer on the same token lists
        assert row["train/tokens"] == sum(sum(s.loss_mask) for s in samples)
        assert row["train/logprob_mismatch_max"] < 1e-3
        assert row["episodes/turns_mean"] == 2.0 and row["episodes/episode_finish/answered"] == 4


def test_async_grpo_over_episodes_keeps_each_episode_within_the_staleness_bound(chat_dir, tmp_path):
    """grpo.max_staleness=1 with the calculator environment: the producer makes the next step's
    episodes while the trainer trains; every episode's policy tokens come from one version (a push
    never lands inside an episode), at most one behind its step, and the loss covers them only."""
    overrides = [
        "rollout.placement=disaggregated",
        "grpo.max_staleness=1",
        "grpo.environment=rollfleet.envs.calculator:Calculator",
        "grpo.dataset=arithmetic",
        "grpo.agent.max_turns=3",
        "grpo.agent.max_total_tokens=128",
        "grpo.steps=3",
        "grpo.prompts_per_step=2",
        "grpo.synthetic_prompts=16",
    ]
    rows, steps = train_episodes(chat_dir, tmp_path, overrides)
    assert [r["step"] for r in rows] == [1, 2, 3] and sorted(steps) == [0, 1, 2]
    for step, row in enumerate(rows):
        samples = steps[step]
        check_complete(samples, 2, 2)
        ages = []
        for s in samples:
            assert s.finish_reason["type"] in {"answered", "answered_without_tool", "max_turns"}, s.finish_reason
            policy = {v for v, keep in zip(s.token_versions, s.loss_mask, strict=True) if keep}
            assert len(policy) == 1 and None not in policy, policy  # one version per episode
            ages.append(step - int(policy.pop()))
        assert all(0 <= age <= 1 for age in ages) and row["staleness_max"] == max(ages), (step, ages)
        assert row["train/tokens"] == sum(sum(s.loss_mask) for s in samples)
        assert row["episodes/turns_mean"] == sum(s.turns for s in samples) / len(samples)
        assert 0 <= row["episodes/tool_only_wall_share"] <= row["episodes/tool_wall_share"] <= 1
    assert any(r["staleness_max"] == 1 for r in rows)  # episodes really were made ahead of the trainer
    assert rows[0]["staleness_max"] == 0  # the first step's episodes come from the first push


def test_bench_agents_prints_its_line_and_record(tmp_path, capsys):
    from rollfleet.bench.agents import main

    record = tmp_path / "agents.json"
    main(["--episodes", "8", "--repeats", "1", "--tool-latency-ms", "5", "--json", str(record)])
    line = capsys.readouterr().out
    assert "8 episodes in flight" in line and "trajectories/s" in line and "turns/s" in line, line
    assert "of episode time waiting on tools" in line
    assert "of the rollout's wall time" in line and "with only tools running (no generate in flight)" in line
    summary = json.loads(record.read_text())["summary"]
    assert summary["trajectories_per_s"]["median"] > 0 and 0 < summary["tool_wait_share"]["median"] < 1
    for row in json.loads(record.read_text())["repeats"]:
        assert 0 <= row["tool_only_wall_share"] <= row["tool_wall_share"] < 1, row
        assert row["tool_wall_share"] > 0  # every pass called the 5 ms tool
