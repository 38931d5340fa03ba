"""Where a fresh engine's first weight push goes, against the same push into a warm engine.

On 2 x H200 a killed engine's restore took 1.1-1.2 s (from a peer over NCCL, or from the trainer's
push over CUDA IPC) against 0.43 s from the page cache, while a steady-state push of the same 2.9 GB
takes about 0.1 s. This probe separates what a just-started engine pays once from what every push
pays: it starts an engine (forked from a zygote, `--load-format dummy`, as a restart does), pushes
the same weights three times over `tensor` and prints each push's wall time, the sender's phases and
the engine's own (ROLLFLEET_SYNC_TIMING=1 lines of its log); then it does the same on a second
fresh engine. One GPU is enough.

    python scripts/gpu_probe_first_push.py [--hidden 2048 --layers 24] [--device cpu] [--out DIR] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from rollfleet.bench.shapes import write_model
from rollfleet.config import TensorSync
from rollfleet.engine.process.launch import EngineProcess, embedded_argv
from rollfleet.engine.process.zygote_client import Zygote
from rollfleet.weights.source import ModuleSource
from rollfleet.weights.transports import EngineTarget, make_transport
from rollfleet.wire.net import free_port


def push(model, url: str, version: str) -> dict:
    """One push (connect, send, disconnect) of `model` into the engine at `url`; wall time and phases."""
    target = EngineTarget(engine_id=0, url=url, num_ranks=1, rank_offset=1, dtype=torch.bfloat16)
    began = time.perf_counter()
    transport = make_transport(TensorSync(bucket_mb=2048), [target], timeout_s=120)
    transport.connect()
    try:
        report = transport.send(ModuleSource(model), version)
    finally:
        transport.disconnect()
    return {"wall_s": time.perf_counter() - began, "sender_s": report.seconds, **report.phases}


def engine_lines(log: Path) -> list[str]:
    return [line.split("WARNING ", 1)[-1] for line in log.read_text().splitlines() if "weight update of" in line]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--pushes", type=int, default=3)
    p.add_argument("--engines", type=int, default=2, help="fresh engines, one after the other")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: to check the script")
    p.add_argument("--out", default=None)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    os.environ["ROLLFLEET_SYNC_TIMING"] = "1"  # engines log each update's phases (inherited by forks)
    out = Path(args.out or tempfile.mkdtemp(prefix="rf-first-push-"))
    model_dir = write_model(out / f"qwen3-h{args.hidden}-l{args.layers}", args.hidden, args.layers, torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(args.device)
    zygote = Zygote(out / "zygote.log", preload_model=str(model_dir))
    results = []
    for number in range(args.engines):
        port, log = free_port(), out / f"engine-{number}.log"
        argv = embedded_argv(str(model_dir), port, load_format="dummy", extra=["--device", args.device])
        began = time.perf_counter()
        engine = EngineProcess(argv, port=port, log_path=log, zygote=zygote)
        try:
            engine.wait_until_up(timeout=300)
            up = time.perf_counter() - began
            pushes = [push(model, engine.url, f"v{i}") for i in range(args.pushes)]
            results.append({"engine": number, "up_s": up, "pushes": pushes, "engine_log": engine_lines(log)})
        finally:
            engine.stop()
        print(json.dumps(results[-1], indent=1), flush=True)
    zygote.close()
    if args.json:
        Path(args.json).write_text(json.dumps({"hidden": args.hidden, "layers": args.layers, "engines": results}))


if __name__ == "__main__":
    main()
