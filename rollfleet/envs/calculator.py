"""The CPU demo's environment (examples/cpu-agent.yaml): arithmetic the model can only answer by
calling a calculator tool.

    user: 123+456        model: <a turn without digits>   = a call of the calculator on the question
    tool: 579            model: 579                       = the answer (a turn with a digit)

The prompt is the question as a user message; a model turn without any digit calls the calculator,
whose result comes back as a tool message; a turn with a digit is the final answer and ends the
episode. Reward: the answer's per-character credit (rollfleet.rewards.basic.copy_digits; 1.0 only
when it is right), and only when the calculator was called first: a tiny model cannot add, so an
answer without the tool is a guess and earns 0. `latency_s` makes every tool call that slow (the
benchmark's slow tool); `fail_on` makes a call on that question raise (tests)."""

from __future__ import annotations

import asyncio
import re

from rollfleet.envs.base import Done, Environment, Observation, Turn
from rollfleet.rewards.basic import copy_digits

_EXPRESSION = re.compile(r"^\s*(\d+)\s*([-+*])\s*(\d+)\s*$")


def evaluate(expression: str) -> int:
    """a+b, a-b or a*b of non-negative integers; ValueError for anything else."""
    match = _EXPRESSION.match(expression)
    if match is None:
        raise ValueError(f"the calculator takes 'a+b', 'a-b' or 'a*b', got {expression!r}")
    left, op, right = int(match[1]), match[2], int(match[3])
    return left + right if op == "+" else left - right if op == "-" else left * right


class Calculator(Environment):
    def __init__(self, latency_s: float = 0.0, fail_on: str | None = None):
        self.latency_s, self.fail_on = latency_s, fail_on
        self.question, self.answer, self.called = "", "", False

    def start(self, item) -> list[dict]:
        self.question, self.answer = item.prompt, item.answer
        return [{"role": "user", "content": item.prompt}]

    async def step(self, turn: Turn) -> Observation | Done:
        if any(char.isdigit() for char in turn.text):
            if not self.called:
                return Done(reward=0.0, reason="answered_without_tool")
            return Done(reward=copy_digits(turn.text, self.answer), reason="answered")
        if self.latency_s:
            await asyncio.sleep(self.latency_s)
        if self.question == self.fail_on:
            raise RuntimeError(f"the calculator failed on {self.question!r}")
        self.called = True
        return Observation(messages=[{"role": "tool", "content": str(evaluate(self.question))}])
