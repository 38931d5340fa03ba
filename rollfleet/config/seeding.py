"""`grpo.seed_sampling`: whether the engines' sampling is seeded from grpo.seed, and what that needs of
the rest of the config (the seeds themselves: rollfleet.fleet.sampling_seeds).

Read from SGLang 0.5.23's own code: SGLang honours `sampling_params.sampling_seed` only when its
server runs deterministic inference (`--enable-deterministic-inference`, which
`--rl-on-policy-target` turns on): `SamplingBatchInfo.from_schedule_batch` builds the seed tensor
only then, and without it every row draws from the device's generator, the field accepted and
ignored. With deterministic inference on, a request that sends no seed is drawn with seed 42, so the
n samples of one prompt (copies with the same tokens and positions) come out the same.
"""

from __future__ import annotations

from rollfleet.config.errors import FieldProblem

# SGLang's flags that turn its deterministic inference on (its arg_groups: fields/exec_.py, attention_hook.py)
DETERMINISTIC_FLAGS = ("--enable-deterministic-inference", "--rl-on-policy-target")


def sglang_deterministic(rollout) -> bool:
    """Whether the SGLang servers run deterministic inference: one of its flags in the command or the
    extras (rollout: a RolloutConfig)."""
    argv = [*rollout.sglang_command, *rollout.server_extras]
    return any(arg.split("=", 1)[0] in DETERMINISTIC_FLAGS for arg in argv)


def sampling_seeded(cfg) -> bool:
    """grpo.seed_sampling with 'auto' resolved where seeds cost next to nothing: the embedded engine
    on CPU, SGLang with its deterministic inference (which seeds every row anyway). Not the embedded
    engine on a GPU: a seeded row leaves its one-pass sampling kernel for the general path (9.3 ms a
    step at 512 rows of a 151,936 vocabulary on an H200, about as long as the decode step itself).
    cfg: a RunConfig, which imports this module: untyped here."""
    choice, rollout = cfg.grpo.seed_sampling, cfg.rollout
    if choice != "auto":
        return choice
    if rollout.backend == "embedded":
        return not rollout.use_gpu
    return sglang_deterministic(rollout)


def check_seeding(cfg) -> None:
    """grpo.seed_sampling=true with backend=sglang needs its deterministic inference (SGLang ignores
    the seeds without it); grpo.seed_sampling=false with SGLang's deterministic inference and n > 1 is
    refused (every sample is then drawn with seed 42: a prompt's n samples would be the same)."""
    rollout, choice = cfg.rollout, cfg.grpo.seed_sampling
    if rollout.backend != "sglang" or choice == "auto":
        return
    deterministic = sglang_deterministic(rollout)
    if choice and not deterministic:
        raise FieldProblem(
            "SGLang ignores sampling_params.sampling_seed unless its servers run deterministic inference",
            "add --enable-deterministic-inference to rollout.server_extras, or set grpo.seed_sampling=auto "
            "(unseeded on SGLang without it)",
            field="grpo.seed_sampling",
            value=True,
        )
    if not choice and deterministic and rollout.sampling.n > 1:
        raise FieldProblem(
            "with deterministic inference SGLang draws every unseeded sample with seed 42, so the "
            f"rollout.sampling.n={rollout.sampling.n} samples of a prompt would all be the same",
            "set grpo.seed_sampling=auto or true (each sample gets a seed of its own)",
            field="grpo.seed_sampling",
            value=False,
        )
