"""The agent demo's dataset (`grpo.dataset: arithmetic`): sums of two 3-digit numbers whose result
has 3 digits, "123+456" -> "579" (rollfleet.envs.calculator answers them)."""

from __future__ import annotations

import random


def make_arithmetic_records(count: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    records = []
    for _ in range(count):
        left = rng.randint(100, 499)
        right = rng.randint(100, 998 - left)
        records.append({"prompt": f"{left}+{right}", "answer": str(left + right)})
    return records
