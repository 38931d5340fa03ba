"""The synthetic task is learnable: GRPO from random weights, in one process, without the fleet.

A plain sampler (the rollout model: a separate HF copy that gets the trainer's weights through
`PolicyTrainer.weight_source()` after every step, as the engines would) + `PolicyTrainer` at world 1.

    python tests/test_task.py --steps 150    # the longer run, prints reward per step
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollfleet.data.prompts import PromptDataset
from rollfleet.data.synthetic import REWARD, make_records
from rollfleet.rewards import load_reward
from rollfleet.rewards.basic import copy_digits, exact_match
from rollfleet.tiny_models import make_tiny_model
from rollfleet.train.fsdp import PolicyTrainer, TrainConfig
from rollfleet.train.grpo import group_advantages
from rollfleet.train.sharding import init_distributed
from rollfleet.wire.net import free_port


@dataclass
class Recipe:
    steps: int = 200
    lr: float = 2e-3
    prompts_per_step: int = 16
    n: int = 16  # samples per prompt (group size)
    max_new_tokens: int = 3
    num_prompts: int = 1000
    scale_adv_by_std: bool = True
    seed: int = 0


@torch.no_grad()
def sample(model, prompt_ids: list[list[int]], max_new_tokens: int, eos: int, generator: torch.Generator):
    """Temperature-1 sampling of equal-length prompts; logprobs of the raw logits, like the engine."""
    input_ids = torch.tensor(prompt_ids)
    out = model(input_ids=input_ids, use_cache=True)
    cache, logits = out.cache, out.logits[:, -1]
    tokens, logprobs = [], []
    for _ in range(max_new_tokens):
        logp = torch.log_softmax(logits.float(), dim=-1)
        token = torch.multinomial(logp.exp(), 1, generator=generator)
        tokens.append(token)
        logprobs.append(logp.gather(-1, token))
        out = model(input_ids=token, cache=cache, use_cache=True)
        cache, logits = out.cache, out.logits[:, -1]
    tokens, logprobs = torch.cat(tokens, 1).tolist(), torch.cat(logprobs, 1).tolist()
    results = []
    for row_tokens, row_logprobs in zip(tokens, logprobs, strict=True):
        end = row_tokens.index(eos) + 1 if eos in row_tokens else len(row_tokens)  # keep the EOS, like the engine
        results.append((row_tokens[:end], row_logprobs[:end]))
    return results


def run_grpo(model_dir: str, recipe: Recipe, log=None) -> dict:
    """GRPO on the copy_digits task at world 1; returns mean reward per step and timings."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    dataset = PromptDataset.from_records(make_records(recipe.num_prompts, seed=recipe.seed))
    reward_fn = load_reward(REWARD)
    config = TrainConfig(
        lr=recipe.lr,
        micro_batch_size=recipe.prompts_per_step * recipe.n,
        scale_adv_by_std=recipe.scale_adv_by_std,
        seed=recipe.seed,
    )
    trainer = PolicyTrainer(model_dir, config)
    rollout = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(recipe.seed)
    rewards_per_step, metrics_per_step = [], []
    start = time.perf_counter()
    for step in range(recipe.steps):
        prompts = dataset.batch(step, recipe.prompts_per_step, seed=recipe.seed)
        prompt_ids = [tokenizer(item.prompt)["input_ids"] for item in prompts for _ in range(recipe.n)]
        samples = sample(rollout, prompt_ids, recipe.max_new_tokens, tokenizer.eos_token_id, generator)
        texts = tokenizer.batch_decode([tokens for tokens, _ in samples], skip_special_tokens=True)
        answers = [item.answer for item in prompts for _ in range(recipe.n)]
        rewards = [reward_fn(text, answer) for text, answer in zip(texts, answers, strict=True)]
        advantages = group_advantages(rewards, recipe.n, scale_by_std=config.scale_adv_by_std).tolist()
        batch = [
            {"prompt_ids": ids, "output_ids": tokens, "logprobs": logprobs, "advantage": adv}
            for ids, (tokens, logprobs), adv in zip(prompt_ids, samples, advantages, strict=True)
        ]
        metrics = trainer.train_step(batch)
        rollout.load_state_dict(dict(trainer.weight_source().named_tensors()))  # the weight sync
        rewards_per_step.append(sum(rewards) / len(rewards))
        metrics_per_step.append(metrics)
        if log:
            log(
                f"step {step:3d}  reward {rewards_per_step[-1]:.3f}  exact "
                f"{sum(exact_match(t, a) for t, a in zip(texts, answers)) / len(texts):.2f}  "
                f"loss {metrics['loss']:+.3f}  mismatch {metrics['logprob_mismatch_max']:.1e}  "
                f"sample {texts[0]!r} for {answers[0]!r}  {time.perf_counter() - start:.1f}s"
            )
    return {
        "rewards": rewards_per_step,
        "metrics": metrics_per_step,
        "seconds": time.perf_counter() - start,
        "last_samples": list(zip(texts, answers, strict=True)),
    }


def test_copy_digits_reward_goes_up_from_random_weights(tmp_path, gloo_world_of_one):
    torch.manual_seed(0)
    model_dir = str(make_tiny_model(tmp_path / "model", "qwen3", seed=0))
    result = run_grpo(model_dir, Recipe(steps=60))
    rewards = result["rewards"]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert first < 0.05 and last > first + 0.12, (first, last, rewards)
    assert max(m["logprob_mismatch_max"] for m in result["metrics"]) < 1e-4  # sampler and trainer agree


def test_reward_functions():
    assert copy_digits("381", "381") == 1.0 and exact_match(" 381\n", "381") == 1.0
    assert copy_digits("3", "381") == pytest.approx(1 / 3)
    assert copy_digits("3812", "381") == pytest.approx((3 + 0.1) / 4)  # an extra digit costs
    assert copy_digits("999", "381") == pytest.approx(0.1)  # right kind, wrong values
    assert copy_digits("813", "381") == pytest.approx(0.25)  # the answer's digits, misplaced
    assert copy_digits("3x8", "381") == pytest.approx((1 + 0.25) / 3)
    assert copy_digits("abc", "381") == 0.0 and exact_match("38", "381") == 0.0
    assert load_reward("rollfleet.rewards.basic:exact_match") is exact_match
    with pytest.raises(ValueError, match="module:function"):
        load_reward("rollfleet.rewards.basic.exact_match")
    with pytest.raises(ValueError, match="no function 'nope'"):
        load_reward("rollfleet.rewards.basic:nope")


def test_prompt_dataset_from_jsonl_batches_and_errors(tmp_path):
    path = tmp_path / "task.jsonl"
    path.write_text("".join(json.dumps(record) + "\n" for record in make_records(5, seed=1)))
    dataset = PromptDataset.from_jsonl(path)
    assert len(dataset) == 5 and dataset[0].prompt.startswith("copy:") and dataset[0].answer in dataset[0].prompt
    epoch = dataset.batch(0, 5, seed=3)
    assert sorted(item.index for item in epoch) == list(range(5))  # one epoch is a permutation
    assert dataset.batch(1, 3, seed=3)[:2] == dataset.batch(0, 5, seed=3)[3:]  # wraps into the next epoch
    assert dataset.batch(7, 3, seed=3) == dataset.batch(7, 3, seed=3)  # a pure function of (seed, step)
    assert dataset.batch(0, 5, seed=4) != epoch
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "answer": "b"}\n\n{"prompt": "c"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:3: missing field 'answer'"):
        PromptDataset.from_jsonl(bad)
    bad.write_text('{"prompt": "a", "answer": 7, "source": "x"}\n{"prompt": "a", answer}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not valid JSON"):
        PromptDataset.from_jsonl(bad)
    item = PromptDataset.from_records([{"prompt": "a", "answer": 7, "source": "x"}])[0]
    assert item.answer == "7" and item.extra == {"source": "x"}
    with pytest.raises(ValueError, match="record 0: field 'prompt' must be a non-empty string"):
        PromptDataset.from_records([{"prompt": "", "answer": "b"}])


if __name__ == "__main__":
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in vars(Recipe()).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=default)
    recipe = Recipe(**vars(parser.parse_args()))
    init_distributed(0, 1, master_port=free_port(), backend="gloo")
    with tempfile.TemporaryDirectory() as scratch:
        begin = time.perf_counter()
        directory = str(make_tiny_model(scratch, "qwen3", seed=recipe.seed))
        result = run_grpo(directory, recipe, log=print)
    rewards = result["rewards"]
    print(
        f"{recipe}\n{len(rewards)} steps in {result['seconds']:.1f} s train loop, "
        f"{time.perf_counter() - begin:.1f} s total; reward first10 {sum(rewards[:10]) / 10:.3f} "
        f"last10 {sum(rewards[-10:]) / 10:.3f}"
    )
    dist.destroy_process_group()
