"""GPU check (issue: robustness, point 11): an engine stopped with SIGSTOP in the middle of an NCCL
weight broadcast. The sender must give up in bounded time, the fleet must kill and restart the
engine, and the push must go through on the retry, as in the GRPO loop (`Fleet.sync_from`).

One embedded engine on one GPU; the sender is this process, holding a Qwen3-shaped model on the other
GPU (on CPU both run with gloo, to try the script). The sender's weight source stops the engine's
process group after `--stop-after` tensors, so the stop lands while buckets are on the wire. The
fleet's probes (1 s apart, 2 failures, 1 s timeout) mark the engine INACTIVE and kill it; the
sender's announcements then fail, it aborts the group, `sync_from` restarts the engine and pushes
again. Prints a JSON report ($OUT/hang-during-sync.json when OUT is set).

    python scripts/gpu_check_hang_during_sync.py [--hidden 2048 --layers 24]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import tempfile
import time
from pathlib import Path

import ray
import torch
from transformers import AutoModelForCausalLM

from rollfleet.bench.shapes import write_model
from rollfleet.config import load_config
from rollfleet.fleet.fleet import Fleet
from rollfleet.weights.source import ModuleSource
from rollfleet.weights.transports import make_transport


class StoppingSource:
    """The model's tensors; after `stop_after` of them (first push only), SIGSTOP the engine."""

    def __init__(self, model, stop_after: int, engine_pgid: int, events: dict):
        self.inner, self.stop_after, self.pgid, self.events = ModuleSource(model), stop_after, engine_pgid, events

    def named_tensors(self):
        for index, item in enumerate(self.inner.named_tensors()):
            if index == self.stop_after and "stopped_at" not in self.events:
                os.killpg(self.pgid, signal.SIGSTOP)
                self.events["stopped_at"] = time.perf_counter()
            yield item


class LocalSender:
    """What the fleet needs of a trainer, in this process: a push per call, over a fresh group."""

    def __init__(self, source_for, device: str, events: dict):
        self.source_for, self.device, self.events = source_for, device, events

    def push_weights(self, spec, targets, version, **options):
        transport = make_transport(spec, targets, device=self.device, **options)
        transport.connect()
        try:
            return transport.send(self.source_for(), version)
        except BaseException:
            self.events.setdefault("send_failed_at", time.perf_counter())
            raise
        finally:
            transport.disconnect()
            self.events.setdefault("disconnected_at", time.perf_counter())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--stop-after", type=int, default=60, help="tensors sent before the engine is stopped")
    p.add_argument("--bucket-mb", type=int, default=64)
    args = p.parse_args()
    gpu = torch.cuda.is_available()
    work = Path(tempfile.mkdtemp(prefix="hang-sync-"))
    dtype = torch.bfloat16 if gpu else torch.float32
    model_dir = write_model(work / "model", args.hidden, args.layers, dtype)
    cfg = load_config(
        None,
        [
            f"rollout.model_path={model_dir}",
            f"rollout.use_gpu={'true' if gpu else 'false'}",
            f"rollout.log_dir={work / 'logs'}",
            "rollout.num_engines=1",
            "rollout.placement=disaggregated",
            "rollout.probe_interval_s=1",
            "rollout.probe_timeout_s=1",
            "rollout.probe_failures=2",
            "weight_sync.transport=nccl",
            f"weight_sync.bucket_mb={args.bucket_mb}",
            "weight_sync.join_timeout_s=60",
        ],
    )
    fleet = Fleet.from_config(cfg)
    report: dict = {"gpu": gpu, "model_dir_bytes": sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))}
    try:
        slot = fleet.slots[0]
        engine_gpu = slot.gpu_ids[0] if slot.gpu_ids else None
        device = f"cuda:{1 - int(engine_gpu)}" if gpu and engine_gpu is not None else ("cuda:0" if gpu else "cpu")
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device)
        events: dict = {}
        pgid = os.getpgid(ray.get(slot.head.engine_pid.remote()))
        sender = LocalSender(lambda: StoppingSource(model, args.stop_after, pgid, events), device, events)
        began = time.perf_counter()
        sync = fleet.sync_from(sender, "v1")  # the loop's path: fails, restarts the engine, pushes again
        done = time.perf_counter()
        history = [(t.old.value, t.new.value, t.why[:120]) for t in slot.lifecycle.history]
        samples = fleet.generate([[5, 6, 7]], n=2, sampling={"max_new_tokens": 8})
        stopped = events.get("stopped_at")
        report.update(
            ok=bool(stopped) and slot.state.value == "ACTIVE" and slot.version == "v1" and len(samples) == 2,
            engine_gpu=engine_gpu,
            sender_device=device,
            stop_landed_mid_send=bool(stopped),
            seconds_stop_to_send_failed=(events["send_failed_at"] - stopped) if stopped else None,
            seconds_stop_to_sender_free=(events["disconnected_at"] - stopped) if stopped else None,
            seconds_stop_to_verified_again=(done - stopped) if stopped else None,
            seconds_total=done - began,
            verified_engines=sync.verified,
            lifecycle=history,
            generated=[s.output_ids for s in samples],
        )
    finally:
        fleet.shutdown()
        ray.shutdown()
    text = json.dumps(report, indent=1, default=str)
    print(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "hang-during-sync.json").write_text(text + "\n")


if __name__ == "__main__":
    main()
