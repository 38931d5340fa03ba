"""The GRPO loop's settings (`grpo.*`): data, reward, steps, checkpoints, asynchronous steps and
dynamic sampling."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from rollfleet.config.agent import AgentConfig, check_environment_path
from rollfleet.config.errors import FieldProblem
from rollfleet.config.section import Section


class GrpoConfig(Section):
    """The loop: data, reward, steps, checkpoints."""

    steps: int = Field(50, ge=1, description="Training steps (one generate + train + sync each).")
    prompts_per_step: int = Field(8, ge=1, description="Prompts per step; each gets rollout.sampling.n samples.")
    dataset: str = Field(
        "synthetic",
        description="'synthetic' (the bundled copy task), 'arithmetic' (the agent demo's sums) or a JSONL path of "
        "{prompt, answer}.",
    )
    # bounded: the dataset is built in memory before anything starts (10**12 digits hung the run there)
    synthetic_prompts: int = Field(512, ge=1, le=1_000_000, description="Size of the synthetic dataset.")
    synthetic_digits: int = Field(3, ge=1, le=10_000, description="Digits per synthetic prompt.")
    reward: str = Field(
        "rollfleet.rewards.basic:copy_digits", description="Reward function, 'package.module:function'."
    )
    environment: str | None = Field(
        None,
        description="Multi-turn episodes instead of single completions: an Environment class, "
        "'package.module:Class' (rollfleet.envs), one instance per episode; its reward replaces grpo.reward.",
    )
    environment_args: dict = Field(default_factory=dict, description="Keyword arguments of the environment class.")
    agent: AgentConfig = Field(default_factory=AgentConfig, description="Limits of each episode (with environment).")
    reward_threads: int = Field(
        4, ge=1, description="Threads computing rewards (slow rewards leave the critical path)."
    )
    output_dir: str = Field(
        "runs/default", description="Metrics, TensorBoard, checkpoints and the reward plot go here."
    )
    checkpoint_every: int = Field(
        0, ge=0, description="Save an HF checkpoint and trainer state every K steps; 0: at the end only."
    )
    final_checkpoint: bool = Field(
        True,
        description="Save an HF checkpoint and trainer state at the end of the run (once, also when "
        "checkpoint_every lands on the last step). false: benches and checks that time steps only (a 2B "
        "model's trainer state is 25 GB to write); the recovery snapshots are not affected.",
    )
    seed: int = Field(0, description="Seed of the prompt order and (seed_sampling) of the engines' sampling.")
    seed_sampling: Literal["auto"] | bool = Field(
        "auto",
        description="Every generate request carries sampling_params.sampling_seed, derived from seed and the "
        "request's place in the run (the prompt's position in the prompt stream, the sample, an episode's turn), "
        "so the same config and seed draw the same samples, whichever engine serves a request, whatever shares "
        "its batch, and when it is sent again. auto: on with the embedded engine on CPU; off with it on a GPU "
        "(seeded rows leave its one-pass sampling kernel: about a decode step's time more at 512 rows); with "
        "sglang on only when its servers run deterministic inference (--enable-deterministic-inference or "
        "--rl-on-policy-target in rollout.server_extras or sglang_command): SGLang ignores the seed without it, "
        "and there each sample of a prompt goes as a copy with a seed of its own (SGLang gives a request's n "
        "copies one seed). false: the engines' own random draws.",
    )
    max_staleness: int = Field(
        0,
        ge=0,
        description="k: samples trained at step s may hold tokens of weight versions s-k..s. 0: the synchronous "
        "loop (generate, train, push). k >= 1 (placement=disaggregated only): the engines keep generating the "
        "next steps' samples with the weights they hold while the trainer trains.",
    )
    dynamic_sampling: bool = Field(
        False,
        description="Drop prompt groups whose rewards are all equal (no gradient) and generate more prompts until "
        "the step has prompts_per_step useful groups, up to dynamic_sampling_max_extra extra prompts per step.",
    )
    dynamic_sampling_max_extra: int = Field(
        16,
        ge=0,
        description="Most extra prompts a step generates to replace dropped groups; once spent, the step trains "
        "on the groups it has, equal rewards included (they carry no gradient).",
    )
    recovery_checkpoint_every: Literal["auto"] | int = Field(
        "auto",
        description="How often the trainer writes the synced weights as a HF directory that a restarted engine "
        "restores from (in the background, from a host copy; a step never waits: a snapshot due while the last "
        "is still being written is skipped and counted as snapshot_skipped). 'auto': only when nothing else can "
        "restore, i.e. a single-engine fleet (with 2+ engines a peer or the trainer's next push restores); "
        "N: every N steps; 0: never. Disk sync writes none: its sync directory already serves.",
    )

    @field_validator("environment")
    @classmethod
    def _environment_path(cls, path):
        """environment is written 'package.module:Class' (whether it imports is checked when the run starts)."""
        return check_environment_path(path)

    @field_validator("recovery_checkpoint_every", mode="before")
    @classmethod
    def _auto_or_step_count(cls, every):
        """recovery_checkpoint_every is 'auto', 0 (never) or a positive step count."""
        if every == "auto" or (isinstance(every, int) and not isinstance(every, bool) and every >= 0):
            return every
        raise FieldProblem(
            "must be 'auto', 0 (never) or a positive step count",
            "use auto (snapshots only when no peer or trainer push can restore an engine), 0, or e.g. 10",
        )
