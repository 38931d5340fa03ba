"""GPU check of the fleet (issue: fleet): Ray places one tp=2 engine, then two tp=1 engines, on a
machine with two GPUs; each generates through the router. Prints a JSON report ($OUT too if set).

    python scripts/gpu_check_fleet.py
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

import ray
import torch

from rollfleet.config import load_config
from rollfleet.fleet.fleet import Fleet
from rollfleet.fleet.placement import init_local_ray
from rollfleet.tiny_models import make_tiny_model


def run_fleet(model_dir: str, log_dir: str, *overrides: str) -> dict:
    cfg = load_config(
        None, [f"rollout.model_path={model_dir}", "rollout.use_gpu=true", f"rollout.log_dir={log_dir}", *overrides]
    )
    start = time.perf_counter()
    fleet = Fleet.from_config(cfg)
    started = time.perf_counter() - start
    try:
        placements = ray.get([w.placement.remote() for w in fleet.workers])
        prompts = [[i % 100 + 1, 2, 3] for i in range(64)]
        start = time.perf_counter()
        samples = fleet.generate(prompts, n=4, sampling={"max_new_tokens": 64, "ignore_eos": True})
        seconds = time.perf_counter() - start
        engine_devices = []
        for slot in fleet.slots:
            pid = ray.get(slot.head.engine_pid.remote())
            env = dict(x.split("=", 1) for x in open(f"/proc/{pid}/environ").read().split("\0") if "=" in x)
            engine_devices.append(env.get("CUDA_VISIBLE_DEVICES"))
        return {
            "overrides": list(overrides),
            "startup_s": round(started, 1),
            "worker_gpus": [p["gpu_ids"] for p in placements],
            "engine_cuda_visible_devices": engine_devices,
            "samples": len(samples),
            "samples_per_engine": {
                e: sum(s.engine_id == e for s in samples) for e in sorted({s.engine_id for s in samples})
            },
            "tokens_per_s": round(sum(len(s.output_ids) for s in samples) / seconds, 1),
            "gpu_memory_used_gb": [
                round((torch.cuda.mem_get_info(i)[1] - torch.cuda.mem_get_info(i)[0]) / 1e9, 2)
                for i in range(torch.cuda.device_count())
            ],
        }
    finally:
        fleet.shutdown()


def main() -> None:
    init_local_ray(num_gpus=torch.cuda.device_count())
    report = {}
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = str(
            make_tiny_model(
                Path(scratch) / "model",
                hidden_size=1024,
                num_hidden_layers=8,
                intermediate_size=4096,
                num_attention_heads=8,
                num_key_value_heads=2,
                head_dim=128,
            )
        )
        logs = os.environ.get("OUT", scratch)
        report["tp2_one_engine"] = run_fleet(
            model_dir, logs, "rollout.tp_size=2", "rollout.server_extras=['--device','cuda']"
        )
        report["tp1_two_engines"] = run_fleet(
            model_dir, logs, "rollout.num_engines=2", "rollout.server_extras=['--device','cuda']"
        )
    ray.shutdown()
    text = json.dumps(report, indent=1)
    print(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_check_fleet.json").write_text(text)


if __name__ == "__main__":
    main()
