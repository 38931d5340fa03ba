"""Time from an engine's death to ACTIVE again, split into detect, restart, restore and verify.

    rollfleet bench recovery [--hidden 256 --layers 8]

A local Ray fleet of two embedded engines (CPU, or GPUs when present) holds weights of version v1
(pushed over disk, so a checkpoint exists). Three ways back: one engine restored from the disk
checkpoint; one engine restored by a trainer push (tensor transport); two engines restored from the
same checkpoint, reading the files once and fanning out vs each engine reading them.
"""

from __future__ import annotations

import argparse
import os
import signal
import tempfile
import time
from pathlib import Path

import ray
import torch
from transformers import AutoModelForCausalLM

from rollfleet.config import TensorSync, load_config
from rollfleet.fleet.fleet import Fleet
from rollfleet.tiny_models import make_tiny_model
from rollfleet.weights.source import ModuleSource


def _kill_and_restart(fleet: Fleet, engine_ids: list[int]) -> dict[str, float]:
    start = time.perf_counter()
    for engine_id in engine_ids:
        os.killpg(ray.get(fleet.slots[engine_id].head.engine_pid.remote()), signal.SIGKILL)
    while any(fleet.slots[e].state.value != "INACTIVE" for e in engine_ids):
        time.sleep(0.005)
    detected = time.perf_counter()
    fleet.restart_inactive(restore=False)
    return {"detect": detected - start, "restart": time.perf_counter() - detected}


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="rollfleet bench recovery")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="rf-bench-") as scratch:
        scratch = Path(scratch)
        model_dir = make_tiny_model(
            scratch / "model",
            hidden_size=args.hidden,
            num_hidden_layers=args.layers,
            intermediate_size=4 * args.hidden,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=args.hidden // 4,
        )
        gpus = torch.cuda.device_count()
        ray.init(
            num_cpus=8, num_gpus=gpus or 2, _temp_dir=str(scratch / "ray"), include_dashboard=False, log_to_driver=False
        )
        cfg = load_config(
            None,
            [
                f"rollout.model_path={model_dir}",
                "rollout.use_gpu=true",
                "rollout.num_engines=2",
                "rollout.auto_restart=false",  # the benchmark times each restart itself
                f"rollout.log_dir={scratch}/logs",
                "weight_sync.transport=disk",
                f"weight_sync.path={scratch}/sync",
            ],
        )
        fleet = Fleet.from_config(cfg)
        rows = []
        try:
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
            with torch.no_grad():
                for param in model.parameters():
                    param.add_(1e-3)
            fleet.sync_weights(ModuleSource(model), "v1", config_dir=str(model_dir))
            checkpoint = fleet.checkpoint_for("v1")
            size_mb = sum(f.stat().st_size for f in Path(checkpoint).glob("*.safetensors")) / 1e6

            times = _kill_and_restart(fleet, [1])
            times["restore"] = _timed(
                lambda: fleet._on_all("update_weights_from_disk", checkpoint, weight_version="v1", engine_ids=[1])
            )
            times["verify"] = _timed(lambda: fleet.verify_checkpoint(checkpoint, "v1", [1]))
            rows.append(("1 engine, disk checkpoint", times))

            times = _kill_and_restart(fleet, [1])
            report_holder = {}
            total = _timed(
                lambda: report_holder.setdefault(
                    "r", fleet.sync_weights(ModuleSource(model), "v1", engine_ids=[1], transport=TensorSync())
                )
            )
            times["restore"] = report_holder["r"].seconds
            times["verify"] = total - times["restore"]
            rows.append(("1 engine, trainer push (tensor)", times))

            for label, fan_out in (
                ("2 engines, each reads the files", False),
                ("2 engines, read once + fan-out", True),
            ):
                times = _kill_and_restart(fleet, [0, 1])
                if fan_out:
                    times["restore+verify"] = _timed(lambda: fleet.restore(checkpoint, "v1", [0, 1], fan_out=True))
                else:
                    times["restore+verify"] = _timed(
                        lambda: fleet.update_weights_from_disk(checkpoint, "v1", engine_ids=[0, 1])
                    )
                rows.append((label, times))
            assert [s.state.value for s in fleet.slots] == ["ACTIVE", "ACTIVE"]
        finally:
            fleet.shutdown()
            ray.shutdown()
    print(
        f"recovery, embedded engines on {'GPU' if gpus else 'CPU'}, checkpoint {size_mb:.1f} MB "
        "(seconds; total = kill to ACTIVE)"
    )
    print(f"  {'path':36} {'detect':>7} {'restart':>8} {'restore':>8} {'verify':>7} {'total':>7}")
    for label, t in rows:
        restore = t.get("restore", t.get("restore+verify"))
        verify = t.get("verify")
        total = t["detect"] + t["restart"] + restore + (verify or 0.0)
        verify_text = f"{verify:7.3f}" if verify is not None else "   (in)"
        print(f"  {label:36} {t['detect']:7.3f} {t['restart']:8.3f} {restore:8.3f} {verify_text} {total:7.3f}")
    print("  targets on CPU: detect < 2 s, total < 20 s")


if __name__ == "__main__":
    main()
