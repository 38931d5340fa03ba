"""Multi-turn agentic rollouts (`grpo.environment`, `grpo.agent.*`): an environment named by import
path, and the limits of each episode."""

from __future__ import annotations

import warnings

from pydantic import Field

from rollfleet.config.errors import FieldProblem
from rollfleet.config.section import Section


class AgentConfig(Section):
    """Limits of one episode (a trajectory of model turns and environment observations)."""

    max_turns: int = Field(4, ge=1, description="Most model turns per episode; then it ends as 'max_turns'.")
    max_total_tokens: int = Field(
        512,
        ge=2,
        description="Most tokens of a trajectory (prompt, model turns and observations); a turn asks for at most "
        "what is left, and an episode that reaches it ends as 'max_tokens'. Keep it within the model's context.",
    )
    tool_timeout_s: float = Field(
        30.0,
        gt=0,
        description="Most seconds an environment step (a tool call) may take; then the episode ends "
        "as 'tool_timeout' with reward failed_reward, and the run goes on.",
    )
    failed_reward: float = Field(
        0.0,
        description="Reward of an episode that a limit, a tool timeout, a tool failure or an engine's refusal "
        "of a turn (a 4xx answer: 'engine_rejected') ended.",
    )
    max_in_flight: int = Field(64, ge=1, description="Episodes running at once (each its own generate calls).")


def check_environment_path(path: str | None) -> str | None:
    """`package.module:Class` (its syntax here; the import itself when the run starts)."""
    if path is None:
        return None
    module, sep, attribute = path.partition(":")
    if not sep or not module or not attribute:
        raise FieldProblem(
            "must name a class as 'package.module:Class'",
            "e.g. grpo.environment=rollfleet.envs.calculator:Calculator, or leave it unset for single-turn samples",
        )
    return path


def check_agent_run(cfg) -> None:
    """What a run with grpo.environment needs of the rest of its config (cfg: a RunConfig)."""
    if cfg.grpo.environment is None:
        return
    if "reward" in cfg.grpo.model_fields_set:
        warnings.warn(
            "grpo.reward is ignored with grpo.environment: the environment rewards each episode", stacklevel=2
        )
    if cfg.train.routing_replay:
        raise FieldProblem(
            "routing replay takes one engine answer's expert choices per sample, and an episode is many answers",
            "set train.routing_replay=false, or leave grpo.environment unset",
            field="train.routing_replay",
            value=True,
        )
    if cfg.rollout.sampling.max_new_tokens >= cfg.grpo.agent.max_total_tokens:
        raise FieldProblem(
            f"a turn of rollout.sampling.max_new_tokens={cfg.rollout.sampling.max_new_tokens} tokens leaves no room "
            "for the prompt within the episode's budget",
            "raise grpo.agent.max_total_tokens or lower rollout.sampling.max_new_tokens (the tokens of one turn)",
            field="grpo.agent.max_total_tokens",
            value=cfg.grpo.agent.max_total_tokens,
        )
