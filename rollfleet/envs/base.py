"""The environment interface: what an episode's environment is given and what it answers."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Turn:
    """One model turn, as the engine returned it (the token ids are the ones the episode keeps)."""

    index: int  # 0 for the first turn
    text: str  # the turn's token ids decoded
    token_ids: list[int]
    finish_reason: dict  # the engine's: {"type": "stop" | "length", ...}
    engine_id: int  # the engine that served it


@dataclass(frozen=True)
class Observation:
    """What the environment appends after a model turn; exactly one of the three.

    messages: chat messages (tool results: {"role": "tool", "content": ...}) rendered with the model's
    chat template, with the markup that closes the model's turn and opens its next one; text: raw
    text, tokenized once as it is; token_ids: appended as they are."""

    messages: list[dict] | None = None
    text: str | None = None
    token_ids: list[int] | None = None

    def __post_init__(self):
        given = [name for name in ("messages", "text", "token_ids") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(f"an Observation takes exactly one of messages, text or token_ids; got {given or 'none'}")


@dataclass(frozen=True)
class Done:
    """The end of an episode, with its reward; `reason` is recorded as its finish reason."""

    reward: float
    reason: str = "done"
    info: dict[str, Any] = field(default_factory=dict)


class Environment:
    """Subclass it; one instance per episode. `sampling`: sampling fields every turn of its episodes
    adds to rollout.sampling (e.g. {"stop": ["</call>"]})."""

    sampling: dict[str, Any] = {}

    def start(self, item) -> str | list[dict]:
        """The episode's prompt for a dataset record (a PromptItem): text as is, or chat messages
        rendered with the chat template and its generation prompt. Called on the rollout's event
        loop: keep it quick (set up slow resources in the first `step`)."""
        return item.prompt

    def step(self, turn: Turn) -> Observation | Done:  # may be `async def`
        raise NotImplementedError(f"{type(self).__name__}.step: answer each model turn with an Observation or Done")


def load_environment(path: str) -> type:
    """Import `package.module:Class`; errors name grpo.environment and which part is wrong."""
    module_name, _, attribute = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(
            f"grpo.environment={path!r}: cannot import module {module_name!r} ({err}) (fix: install the package "
            "that holds it or put it on PYTHONPATH, or name another class, e.g. rollfleet.envs.calculator:Calculator)"
        ) from err
    cls = getattr(module, attribute, None)
    if not isinstance(cls, type) or not callable(getattr(cls, "step", None)):
        raise ValueError(
            f"grpo.environment={path!r}: {module_name!r} has no class {attribute!r} with a step(turn) method "
            "(fix: subclass rollfleet.envs.Environment and name it here)"
        )
    return cls
