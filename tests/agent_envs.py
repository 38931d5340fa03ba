"""Environments the agent tests name (by import path or by class): each records what it was given."""

from __future__ import annotations

import asyncio
import threading

from rollfleet.envs import Done, Environment, Observation


class Scripted(Environment):
    """Turn k gets `script[k]` (("messages" | "text" | "token_ids", value)); the turn after the script
    ends the episode with reward = its number of distinct token ids. Every instance appends itself to
    `record` at start; `gate` (a threading.Event), when given, holds turn `hold_turn`'s step until set."""

    def __init__(self, record: list, script: list, gate: threading.Event | None = None, hold_turn: int = 0):
        self.record, self.script, self.gate, self.hold_turn = record, script, gate, hold_turn
        self.turns, self.prompt, self.held = [], None, False

    def start(self, item):
        self.prompt = item.prompt
        self.record.append(self)
        return [{"role": "user", "content": item.prompt}]

    async def step(self, turn):
        self.turns.append(turn)
        if self.gate is not None and turn.index == self.hold_turn:
            self.held = True
            while not self.gate.is_set():  # the test releases the episodes once the fleet is as it wants
                await asyncio.sleep(0.01)
        if turn.index < len(self.script):
            kind, value = self.script[turn.index]
            return Observation(**{kind: value})
        return Done(reward=float(len(set(turn.token_ids))), reason="scripted")


class Troubled(Environment):
    """By prompt: "hang" never answers its first step, "fail" raises, "chatty" observes forever (turn
    limit), "long" observes 200 ids (token limit), "past_context" observes 600 ids (past the tiny
    models' context length of 512: the engine refuses the next turn), "bad_token" observes an id
    outside the vocabulary (refused too); any other prompt ends after one turn."""

    def start(self, item):
        self.prompt = item.prompt
        return item.prompt

    async def step(self, turn):
        if self.prompt == "hang":
            await asyncio.Event().wait()  # a tool that never returns: the per-turn timeout ends it
        if self.prompt == "fail":
            raise ConnectionError("the tool's server went away")
        if self.prompt == "chatty":
            return Observation(text=" more")
        if self.prompt == "long":
            return Observation(token_ids=[7] * 200)
        if self.prompt == "past_context":
            return Observation(token_ids=[7] * 600)
        if self.prompt == "bad_token":
            return Observation(token_ids=[5, 10**6])
        return Done(reward=1.0, reason="fine")


class Echo(Environment):
    """For the loop: one tool message with the prompt, then Done rewarding a turn that holds a digit."""

    def start(self, item):
        return [{"role": "user", "content": item.prompt}]

    def step(self, turn):  # a plain method: run on a thread
        if turn.index == 0:
            return Observation(messages=[{"role": "tool", "content": "42"}])
        return Done(reward=float(any(c.isdigit() for c in turn.text)), reason="answered")
