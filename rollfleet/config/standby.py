"""Where standby engines may live, checked before anything starts.

A standby lives on GPUs of its own, or beside a serving engine on that engine's GPUs
(`rollout.standby_beside`, disaggregated fleets): then the two processes split each GPU's memory by
their fractions (`mem_fraction_static` for serving engines, `standby_mem_fraction_static` for
standbys; SGLang's `--mem-fraction-static`, a cap on the embedded engine's allocator), and a layout
whose fractions add up to more than the whole GPU is refused with the sums.
"""

from __future__ import annotations

from collections import Counter

from rollfleet.config.errors import FieldProblem


def check_standby_beside(rollout) -> None:
    """Raise FieldProblem for a `standby_beside` layout that cannot work (rollout: a RolloutConfig)."""
    beside = rollout.standby_beside
    if not beside:
        return
    if len(beside) != rollout.standby_engines:
        raise FieldProblem(
            f"names a host engine for {len(beside)} standbys, but rollout.standby_engines={rollout.standby_engines}",
            f"give one serving engine id per standby (a list of {rollout.standby_engines}), or leave it empty",
            field="standby_beside",
            value=beside,
        )
    wrong = [e for e in beside if not 0 <= e < rollout.num_engines]
    if wrong:
        raise FieldProblem(
            f"engine ids {wrong} are not serving engines (0..{rollout.num_engines - 1})",
            f"use ids below rollout.num_engines={rollout.num_engines}",
            field="standby_beside",
            value=beside,
        )
    engine, standby = rollout.mem_fraction_static, rollout.standby_mem_fraction_static
    if engine is None or standby is None:
        raise FieldProblem(
            "a standby beside an engine shares its GPUs: both need a memory fraction",
            "set rollout.mem_fraction_static and rollout.standby_mem_fraction_static (e.g. 0.45 each)",
            field="standby_beside",
            value=beside,
        )
    for host, count in sorted(Counter(beside).items()):
        total = engine + count * standby
        if total > 1.0:
            raise FieldProblem(
                f"engine {host}'s GPUs would hold {engine} + {count} x {standby} = {total:.2f} of their memory",
                "lower rollout.mem_fraction_static or rollout.standby_mem_fraction_static, or spread the standbys",
                field="standby_beside",
                value=beside,
            )


def mem_fraction(rollout, engine_id: int) -> float | None:
    """The memory fraction engine `engine_id` of the placed fleet starts with. It belongs to the slot
    (where it lives), not to its role: a standby that takes a dead engine's place keeps its own."""
    if engine_id >= rollout.num_engines and rollout.standby_mem_fraction_static is not None:
        return rollout.standby_mem_fraction_static
    return rollout.mem_fraction_static
