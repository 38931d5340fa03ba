"""Run `make demo` (examples/cpu-demo.yaml) once per seed, one after another, and record the reward
of each run: the mean over its first 10 and last 10 steps (README's demo figure).

    python scripts/demo_seeds.py --seeds 0 1 2 --json docs/results/demo-cpu.json [key.path=value ...]
    python scripts/demo_seeds.py --config examples/cpu-demo-lora.yaml --json docs/results/demo-cpu-lora.json \
        'weight_sync.path={scratch}/adapters'
    python scripts/demo_seeds.py --config examples/cpu-agent.yaml --json docs/results/demo-cpu-agent.json \
        --curves docs/demo-agent-curves.png

An override's `{scratch}` is the run's temporary directory.

`grpo.seed` sets the prompt order and, on the CPU (`grpo.seed_sampling: auto`), the seed of every
sample the engine draws, so a run of one seed repeats its samples; `grpo.seed_sampling=false` gives
the engine's own random draws. The record says which (`config.sampling_seeded`). Each run writes
into its own temporary directory (model, metrics, checkpoints).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rollfleet.bench.record import command_line, make_record, spread, start, write_record
from rollfleet.config import load_config

WINDOW = 10  # steps averaged at each end


def run_one(seed: int, overrides: list[str], config: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="rf-demo-") as scratch:
        argv = [f"grpo.seed={seed}", f"grpo.output_dir={scratch}", f"rollout.model_path={scratch}/tiny-qwen3"]
        argv += [o.replace("{scratch}", scratch) for o in overrides]
        start = time.perf_counter()
        command = [sys.executable, "-m", "rollfleet.demo", config, *argv]
        done = subprocess.run(command, capture_output=True, text=True)
        seconds = time.perf_counter() - start
        if done.returncode != 0:
            raise SystemExit(f"demo with seed {seed} failed (rc {done.returncode}):\n{done.stderr[-3000:]}")
        rows = [json.loads(line) for line in (Path(scratch) / "metrics.jsonl").read_text().splitlines() if line]
    rewards = [row["reward_mean"] for row in rows]
    return {
        "seed": seed,
        "steps": len(rows),
        "reward_first": statistics.fmean(rewards[:WINDOW]),
        "reward_last": statistics.fmean(rewards[-WINDOW:]),
        "seconds_of_steps": sum(row["time/total"] for row in rows),
        "seconds_end_to_end": seconds,
        "other_share_of_step_time": sum(row["time/other"] for row in rows) / sum(row["time/total"] for row in rows),
        "rewards": rewards,  # every step's mean reward (the curve)
    }


def plot_curves(runs: list[dict], path: str) -> None:
    """Every run's mean reward per step, one line per seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(figsize=(6, 3.5))
    for r in runs:
        axes.plot(range(1, len(r["rewards"]) + 1), r["rewards"], label=f"grpo.seed={r['seed']}")
    axes.set_xlabel("step")
    axes.set_ylabel("mean reward")
    axes.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="scripts/demo_seeds.py")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--json", default=None)
    parser.add_argument("--config", default="examples/cpu-demo.yaml", help="the demo's config (a .yaml)")
    parser.add_argument("--curves", default=None, help="also plot every seed's reward curve into this .png")
    parser.add_argument("overrides", nargs="*", help="extra key.path=value overrides of the config")
    args = parser.parse_args(argv)
    started = start()
    runs = []
    for seed in args.seeds:
        runs.append(run_one(seed, args.overrides, args.config))
        r = runs[-1]
        print(
            f"seed {seed}: reward {r['reward_first']:.3f} (first {WINDOW} steps) -> {r['reward_last']:.3f} "
            f"(last {WINDOW}), {r['steps']} steps, {r['seconds_of_steps']:.0f} s of steps, "
            f"{r['seconds_end_to_end']:.0f} s end to end",
            flush=True,
        )
    summary = {
        "window_steps": WINDOW,
        "reward_first": spread([r["reward_first"] for r in runs]),
        "reward_last": spread([r["reward_last"] for r in runs]),
        "seconds_of_steps": spread([r["seconds_of_steps"] for r in runs]),
        "seconds_end_to_end": spread([r["seconds_end_to_end"] for r in runs]),
    }
    run_config = load_config(args.config, [o.replace("{scratch}", "scratch") for o in args.overrides])
    config = {
        "config_file": args.config,
        "seeds": args.seeds,
        "overrides": args.overrides,
        "sampling_seeded": run_config.sampling_seed is not None,  # grpo.seed_sampling, auto resolved
    }
    record = make_record(
        "demo", command_line(["python", "scripts/demo_seeds.py"], argv), config, runs, summary, True, started=started
    )
    write_record(args.json, record)
    if args.curves:
        plot_curves(runs, args.curves)


if __name__ == "__main__":
    main()
