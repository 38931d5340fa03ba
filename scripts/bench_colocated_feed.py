"""Colocated tensor sync: rank 0 feeding every engine vs every trainer rank feeding the engines on
its own GPU (issue 13 point 3), in the same run, alternating. On a machine without GPUs the fleet
runs on the CPU (Ray told it has GPUs: the placement is the colocated one, the handles are shared
memory); with GPUs, on them. Prints a JSON summary ($OUT/colocated_feed.json too if set).

    python scripts/bench_colocated_feed.py --hidden 512 --layers 8 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import ray
import torch

from rollfleet.config import load_config
from rollfleet.fleet.fleet import Fleet
from rollfleet.tiny_models import make_tiny_model
from rollfleet.train.worker import TrainerGroup


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--engines", type=int, default=2, help="tp=1 engines, one per GPU (= trainer ranks)")
    parser.add_argument("--bucket-mb", type=float, default=16.0)
    parser.add_argument("--repeats", type=int, default=5)
    return parser.parse_args()


def start(args, work: Path) -> tuple[Fleet, TrainerGroup]:
    model = make_tiny_model(
        work / "model", hidden_size=args.hidden, num_hidden_layers=args.layers, intermediate_size=4 * args.hidden
    )
    gpus = torch.cuda.device_count()
    ray.init(
        num_cpus=max(8, 2 * args.engines), num_gpus=gpus or args.engines, _temp_dir=str(work / "ray"),
        include_dashboard=False, log_to_driver=False,
    )  # fmt: skip
    cfg = load_config(
        None,
        [
            f"rollout.model_path={model}",
            "rollout.use_gpu=true",
            "rollout.auto_restart=false",
            "rollout.placement=colocated",
            "rollout.gpus_per_worker=0.5",
            f"rollout.num_engines={args.engines}",
            f"trainer.world_size={args.engines}",
            "weight_sync.transport=tensor",
            f"weight_sync.bucket_mb={args.bucket_mb}",
            f"rollout.log_dir={work / 'logs'}",
        ],
    )
    fleet = Fleet.from_config(cfg)
    return fleet, TrainerGroup(cfg, fleet.placement_group)


def measure(fleet: Fleet, trainers: TrainerGroup, repeats: int) -> dict:
    """Pushes (each verified by the fleet) in both modes, alternating; a warm-up push of each first."""
    every_rank = trainers.feeders
    modes = {"rank0_feeds_all": None, "every_rank_feeds_its_gpu": every_rank}
    seconds: dict[str, list[float]] = {mode: [] for mode in modes}
    report = None
    for repeat in range(repeats + 1):
        for mode, feeders in modes.items():
            trainers.feeders = feeders
            report = fleet.sync_from(trainers, f"{mode}-{repeat}")
            if repeat:  # the first of each builds its transport and group
                seconds[mode].append(report.seconds)
    trainers.feeders = every_rank
    return {
        "bytes": report.bytes,
        "feeds": report.feeds,
        "median_s": {mode: round(statistics.median(s), 4) for mode, s in seconds.items()},
        "seconds": {mode: [round(x, 4) for x in s] for mode, s in seconds.items()},
        "phases_last_every_rank": {k: round(v, 4) for k, v in report.phases.items()},
    }


def main() -> None:
    args = parse()
    with tempfile.TemporaryDirectory(prefix="rf-feed-bench-") as temp:
        fleet, trainers = start(args, Path(temp))
        try:
            began = time.perf_counter()
            result = {"args": vars(args), "device": "cuda" if torch.cuda.is_available() else "cpu"}
            result.update(measure(fleet, trainers, args.repeats))
            result["wall_s"] = round(time.perf_counter() - began, 1)
        finally:
            trainers.shutdown()
            fleet.shutdown()
            ray.shutdown()
    print(json.dumps(result, indent=2))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "colocated_feed.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
