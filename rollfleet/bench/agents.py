"""Multi-turn episodes per second on CPU: the demo's calculator episodes, many in flight.

    rollfleet bench agents [--episodes 64] [--tool-latency-ms 20] [--engines 1] [--repeats 3] [--set K=V] [--json F]

A tiny chat model (hidden 64, 2 layers, ChatML) built in a temp directory, a Ray fleet of embedded
engines, and `--episodes` episodes of rollfleet.envs.calculator at once (all in flight), each tool
call taking `--tool-latency-ms` (a slow tool). Per repeat: trajectories/s and turns/s over the wall
time, and what the tools cost (rollfleet.agents.figures): the share of the episodes' time spent
waiting on tools (the sum of their tool waits over the sum of their generate and tool waits), the
share of the rollout's wall time during which at least one episode waited on a tool, and the share
during which only tools ran (no generate call in flight: the wall time the tools added).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import ray

from rollfleet.agents.figures import episode_figures
from rollfleet.agents.rollout import AgentRollout
from rollfleet.bench.record import command_line, make_record, spread, start, write_record
from rollfleet.config import load_config
from rollfleet.config.agent import AgentConfig
from rollfleet.data.arithmetic import make_arithmetic_records
from rollfleet.data.prompts import PromptDataset
from rollfleet.envs.calculator import Calculator
from rollfleet.fleet.fleet import Fleet
from rollfleet.tiny_models import CHATML_TEMPLATE, make_tiny_model

SUMMARY = ("trajectories_per_s", "turns_per_s", "tool_wait_share", "tool_wall_share", "tool_only_wall_share")


def _pass(rollout: AgentRollout, items: list) -> dict:
    began = time.perf_counter()
    samples = rollout.run(items, n=1)
    wall = time.perf_counter() - began
    figures = episode_figures(samples)
    turns = sum(s.turns for s in samples)
    return {
        "seconds": wall,
        "trajectories_per_s": len(samples) / wall,
        "turns_per_s": turns / wall,
        "turns_mean": figures["turns_mean"],
        "tool_wait_share": figures["tool_wait_share"],
        "tool_wall_share": figures["tool_wall_share"],
        "tool_only_wall_share": figures["tool_only_wall_share"],
        "finish": figures["episode_finish"],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="rollfleet bench agents")
    parser.add_argument("--episodes", type=int, default=64, help="episodes in flight (all of a pass at once)")
    parser.add_argument("--tool-latency-ms", type=float, default=20.0)
    parser.add_argument("--engines", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config override, e.g. 'rollout.server_extras=[--enable-mixed-chunk]' (repeatable)",
    )
    parser.add_argument("--json", default=None, help="write the record (rollfleet/bench/record.py) to this file")
    args = parser.parse_args(argv)
    command, started = command_line(["rollfleet", "bench", "agents"], argv), start()
    owns_ray = not ray.is_initialized()  # a Ray the caller started stays up
    with tempfile.TemporaryDirectory() as scratch:
        model = make_tiny_model(Path(scratch) / "model", chat_template=CHATML_TEMPLATE)
        overrides = [f"rollout.model_path={model}", f"rollout.num_engines={args.engines}"]
        overrides += [f"rollout.log_dir={scratch}/logs", "rollout.sampling.max_new_tokens=3", "ray.num_cpus=4"]
        overrides += args.set
        fleet = Fleet.from_config(load_config(None, overrides))
        try:
            limits = AgentConfig(max_turns=3, max_total_tokens=128, max_in_flight=args.episodes)
            rollout = AgentRollout(fleet, Calculator, {"latency_s": args.tool_latency_ms / 1000}, limits)
            dataset = PromptDataset.from_records(make_arithmetic_records(args.episodes * (args.repeats + 1)))
            batches = [dataset.batch(i, args.episodes) for i in range(args.repeats + 1)]
            _pass(rollout, batches[0])  # warm-up
            rows = [{"repeat": i + 1, **_pass(rollout, items)} for i, items in enumerate(batches[1:])]
        finally:
            fleet.shutdown()
            if owns_ray:
                ray.shutdown()
    summary = {key: spread([r[key] for r in rows]) for key in SUMMARY}
    median = {key: statistics.median(r[key] for r in rows) for key in summary}
    print(
        f"agents: {args.episodes} episodes in flight, {args.engines} embedded engine(s) on CPU, tool "
        f"{args.tool_latency_ms:.0f} ms, median of {args.repeats}: {median['trajectories_per_s']:.1f} trajectories/s, "
        f"{median['turns_per_s']:.1f} turns/s, {median['tool_wait_share']:.0%} of episode time waiting on tools; "
        f"of the rollout's wall time, {median['tool_wall_share']:.0%} with an episode waiting on a tool, "
        f"{median['tool_only_wall_share']:.0%} with only tools running (no generate in flight)"
    )
    config = {k: v for k, v in vars(args).items() if k != "json"}
    config["model"] = "tiny test model (hidden 64, 2 layers, ChatML), max_new_tokens 3 per turn, max_turns 3"
    write_record(args.json, make_record("agents", command, config, rows, summary, True, started=started))


if __name__ == "__main__":
    main()
