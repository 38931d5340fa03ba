"""The bundled synthetic task, `copy_digits`: the prompt shows a few digits, the answer repeats them.

    "copy:381=" -> "381"          reward: rollfleet.rewards.basic:copy_digits

Why this task: a randomly initialised tiny model (rollfleet.tiny_models: hidden 64, 2 layers, a 320-token
byte-level vocabulary in which every digit is one token) learns it from scratch with GRPO in a
few CPU minutes. The reward is verifiable (a function of the text and the answer) and dense: any
digit earns a little, a digit of the answer more, the right digit in the right place full credit,
so random samples already differ in reward. The policy first learns to write digits, then the
prompt's digits, then their order; the last step needs attention (copy the token `num_digits`
positions back), so a rising reward shows that sampling, rewards, advantages, the trainer and the
weight sync all work together.

Recipe measured in-process (tests/test_task.py, 2-core CPU, world 1, temperature 1): num_digits=3,
max_new_tokens=3, 16 prompts x n=16 per step, lr 2e-3, std-scaled advantages: mean reward 0.015 over
the first 10 steps, 0.23-0.32 over steps 70-80, 0.62-0.72 over steps 190-200 (seeds 0-3; ~60 ms a
step in one process), about 20% exact copies by then. Smaller batches (8 x 8) learn too, but slower
and noisier (0.35-0.52 after 400 steps); without std scaling it stalls near 0.37.
Sample exactly `num_digits` new tokens: the reward
counts extra characters against the sample, and stopping is not what this task teaches.
"""

from __future__ import annotations

import random

REWARD = "rollfleet.rewards.basic:copy_digits"


def make_records(count: int, *, num_digits: int = 3, seed: int = 0) -> list[dict[str, str]]:
    """`count` random records {"prompt": "copy:381=", "answer": "381"} (repeats are possible)."""
    if num_digits < 1 or count < 1:
        raise ValueError(f"count={count}, num_digits={num_digits}: both must be >= 1")
    rng = random.Random(seed)
    records = []
    for _ in range(count):
        digits = "".join(rng.choice("0123456789") for _ in range(num_digits))
        records.append({"prompt": f"copy:{digits}=", "answer": digits})
    return records
