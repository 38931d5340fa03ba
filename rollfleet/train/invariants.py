"""What a step's samples must satisfy before the trainer trains on them, checked every step as code
(not asserts, so they hold under `python -O`), each failure a named error.

- Synchronous steps (grpo.max_staleness = 0): every sample comes from the step's weight version.
- Asynchronous steps (k >= 1): no sample used at step s holds a token of a version older than s - k,
  or of a version the trainer has not pushed yet (newer than s). A sample's version is the OLDEST
  one its tokens came from (`oldest_version`): SGLang's `meta_info.weight_version` names the version
  that finished the request, and `meta_info.weight_versions` (spans of {version, start, end}) lists
  every version when the weights changed mid-request.
- Always: every prompt of the step has its n samples, once each.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from rollfleet.sample import Sample


class StepInvariantError(RuntimeError):
    """A step's samples broke the loop's ordering; training on them would be wrong."""


class StaleSamples(StepInvariantError):
    pass


class LostOrDuplicatedSamples(StepInvariantError):
    pass


def version_number(version: str) -> int:
    """A weight version as the step that produced it (the loop pushes str(step)); StaleSamples for a
    label that is not a step number, whose age cannot be known."""
    try:
        return int(version)
    except (TypeError, ValueError):
        raise StaleSamples(
            f"weight version {version!r} is not a step number: an asynchronous run pushes str(step) before its "
            "first step, so every engine it generates with reports one"
        ) from None


def oldest_version(weight_version: str, spans: Sequence[dict] | None = None) -> int:
    """The oldest weight version among a sample's tokens: the smallest of its `weight_versions` spans
    when the engine reported them (the weights changed while it was generated), else its one
    `weight_version`."""
    if spans:
        return min(version_number(str(span["version"])) for span in spans)
    return version_number(weight_version)


def sample_version(sample: Sample) -> int:
    """`oldest_version` of a sample (its spans, where the engine reported them)."""
    return oldest_version(sample.weight_version, getattr(sample, "weight_versions", None))


def check_samples(samples: list[Sample], num_prompts: int, n: int, version: str) -> None:
    """Raise unless every sample comes from `version` and every prompt has its n samples, once each."""
    stale = [(s.prompt_index, s.engine_id, s.weight_version) for s in samples if s.weight_version != version]
    if stale:
        raise StaleSamples(
            f"{len(stale)} samples are not from weight version {version!r} (prompt, engine, version): {stale[:5]}"
        )
    check_complete(samples, num_prompts, n)


def check_staleness(samples: list[Sample], step: int, max_staleness: int) -> list[int]:
    """Each sample's staleness (step - its oldest version); StaleSamples when one is above
    `max_staleness` or below 0 (a version the trainer has not pushed before this step)."""
    ages = [step - sample_version(s) for s in samples]
    bad = [
        (s.prompt_index, s.engine_id, s.weight_version)
        for s, age in zip(samples, ages)
        if not 0 <= age <= max_staleness
    ]
    if bad:
        raise StaleSamples(
            f"{len(bad)} samples at step {step} hold tokens outside weight versions "
            f"{step - max_staleness}..{step} (grpo.max_staleness={max_staleness}) (prompt, engine, version): {bad[:5]}"
        )
    return ages


def check_complete(samples: list[Sample], num_prompts: int, n: int) -> None:
    """Raise unless every prompt 0..num_prompts-1 has its n samples, once each."""
    counts = Counter((s.prompt_index, s.sample_index) for s in samples)
    wanted = {(p, k) for p in range(num_prompts) for k in range(n)}
    missing = sorted(wanted - set(counts))
    extra = sorted(key for key, count in counts.items() if count > 1 or key not in wanted)
    if missing or extra:
        raise LostOrDuplicatedSamples(
            f"(prompt, sample) pairs missing: {missing[:5]} ({len(missing)}), duplicated or unknown: "
            f"{extra[:5]} ({len(extra)}), of {num_prompts} prompts x n={n}"
        )


def producer_room(version: int, next_step: int, max_staleness: int, prompts_per_step: int, queued: int) -> int:
    """How many more prompt groups may start generating now, at weight `version`, so that none is
    used later than step version + max_staleness.

    Groups are used first in, first out, prompts_per_step per step, from `next_step` (the first step
    that has not taken its samples) on. The `queued` groups (generated or generating, not taken)
    come first, so a new group is used at step next_step + queued // prompts_per_step at the latest
    (dynamic sampling only takes groups sooner). k = 0 allows one step's groups once the trainer has
    pushed that step's version: the synchronous loop.
    """
    usable_steps = version + max_staleness - next_step + 1
    return max(usable_steps * prompts_per_step - queued, 0)
