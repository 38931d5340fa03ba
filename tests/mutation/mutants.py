"""The mutants of the mutation check (tests/mutation/check.py): one per claimed invariant.

Each replaces one exact snippet of the package with code that breaks the claim, and names the
tests that must then fail. Keep the snippets short and unique; the check fails on a stale one."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mutant:
    id: str
    claim: str  # the invariant the mutant breaks
    file: str  # relative to the repository root
    old: str  # exact snippet, occurring once
    new: str
    tests: tuple[str, ...]  # pytest node ids that must fail on the mutant


MUTANTS: list[Mutant] = [
    Mutant(
        id="engine-reads-released-weights",
        claim="weight reads after a weights release are refused with 400 and touch no freed memory",
        file="rollfleet/engine/model.py",
        old="        if self.weights_released():\n            raise WeightUpdateError(\n",
        new="        if False:\n            raise WeightUpdateError(\n",
        tests=(
            "tests/test_engine_robustness.py::test_weight_reads_after_a_release_are_refused_and_touch_no_freed_memory",
        ),
    ),
    Mutant(
        id="engine-follower-survives-failed-batch",
        claim="a tp follower whose batch action fails like rank 0's goes on with the next batch",
        file="rollfleet/engine/lockstep.py",
        old="            if action in BATCH_ACTIONS:",
        new="            if False:",
        tests=(
            "tests/test_engine_tp_follower.py::"
            "test_a_batch_failing_on_every_rank_aborts_its_requests_and_both_ranks_go_on",
        ),
    ),
]
