"""Reward functions: `reward(sample_text, answer) -> float`, pure functions of the text.

`exact_match` is the strict, general one. `copy_digits` is the synthetic task's reward
(rollfleet.data.synthetic): exact copies score 1, and near misses earn partial credit so that a
policy starting from random weights gets a signal to climb.
"""

from __future__ import annotations

MISPLACED_CREDIT = 0.25  # a digit of the answer, in the wrong place
DIGIT_CREDIT = 0.1  # some other digit: right kind of character, wrong value


def exact_match(sample_text: str, answer: str) -> float:
    """1.0 when the sample equals the answer after stripping surrounding whitespace, else 0.0."""
    return float(sample_text.strip() == answer.strip())


def copy_digits(sample_text: str, answer: str) -> float:
    """Per-character credit of the sample against the answer, in [0, 1]; 1.0 only for an exact copy.

    Position i of the stripped sample earns 1 when it equals answer[i], MISPLACED_CREDIT when it
    is a digit found elsewhere in the answer, DIGIT_CREDIT when it is some other digit, 0
    otherwise; the sum is divided by max(len(sample), len(answer)), so missing characters and
    extra ones both cost.
    """
    sample, answer = sample_text.strip(), answer.strip()
    length = max(len(sample), len(answer))
    if length == 0:
        return 1.0
    score = 0.0
    for position, char in enumerate(sample):
        if position < len(answer) and char == answer[position]:
            score += 1.0
        elif char.isdigit():
            score += MISPLACED_CREDIT if char in answer else DIGIT_CREDIT
    return score / length
