"""What a colocated run's trainer kept allocated on its GPU after each give-back, against the memory
plan's trainer state (parameters and optimizer state: gradients are freed by the step), from the run's
output dir (memory-plan.json, metrics.jsonl). One line; LEAK when a step kept more than the state and
0.5 GiB, or more than its first step did (a sync's buffers held past the sync did both on 2026-12-06).

    python scripts/trainer_kept.py RUN_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

GIB = 1 << 30
SLACK = 0.5 * GIB


def verdict(state_bytes: float, kept: list[float]) -> str:
    """The line for these figures (bytes); LEAK as the module docstring says."""
    figures = " ".join(f"{k / GIB:.2f}" for k in kept)
    leaks = [k for k in kept if k > state_bytes + SLACK or k > kept[0] + SLACK]
    return f"trainer kept after its give-back (GiB): {figures}; its state (plan) {state_bytes / GIB:.2f}: " + (
        "LEAK: more than its state, or than at its first step" if leaks else "ok"
    )


def main(run_dir: str) -> int:
    root = Path(run_dir)
    plan_file, metrics_file = root / "memory-plan.json", root / "metrics.jsonl"
    if not plan_file.is_file() or not metrics_file.is_file():
        print(f"trainer kept: no memory-plan.json or metrics.jsonl in {run_dir} (not colocated, or the run failed)")
        return 0
    state = json.loads(plan_file.read_text())["parts_gb"]["trainer_state"] * 1e9
    rows = [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()]
    kept = [r["trainer_allocated_after_bytes"] for r in rows if r.get("trainer_allocated_after_bytes") is not None]
    if not kept:
        print("trainer kept: no step gave memory back (nothing was released for the trainer's turn)")
        return 0
    print(verdict(state, kept))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
