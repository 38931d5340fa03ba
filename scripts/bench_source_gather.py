"""The trainer's weight source on a real FSDP2 model (world 2 on one machine: gloo on CPU, NCCL with
2 GPUs): seconds to produce every full tensor, by way of gathering. Prints a JSON summary
($OUT/source_gather.json too if set).

- per_parameter: `DTensor.full_tensor()` one parameter at a time (the source before the bucketed gather);
- fsdp_unshard: FSDP2's own `unshard()`/`reshard()` of each sharded module (one all-gather per layer,
  in the trainer's mixed-precision param dtype);
- bucketed_<N>mb: ModuleSource (rollfleet.weights.gather: one all-gather per ~N MB of whole layers);
- bucketed_bf16_<N>mb: the same, each shard cast to bf16 before the gather (a bf16 engine's push).

    python scripts/bench_source_gather.py --hidden 512 --layers 8 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from rollfleet.tiny_models import make_tiny_model
from rollfleet.train.fsdp import PolicyTrainer, TrainConfig
from rollfleet.train.sharding import init_distributed
from rollfleet.weights.source import ModuleSource
from rollfleet.wire.net import free_port


def per_parameter(model) -> int:
    return sum(
        (p.full_tensor() if isinstance(p, DTensor) else p).numel() for _, p in model.named_parameters()
    )  # fmt: skip


def fsdp_unshard(model) -> int:
    total = 0
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.unshard()
            total += sum(p.numel() for p in module.parameters(recurse=False))
            for child in module.children():  # the module's own parameters live in non-FSDP children too
                if not isinstance(child, FSDPModule):
                    total += sum(p.numel() for p in child.parameters())
            module.reshard()
    return total


def source(model, dtype=None, gather_mb: float = 256) -> int:
    source = ModuleSource(model, dtype=dtype, gather_bytes=int(gather_mb * (1 << 20)))
    return sum(t.numel() for _, t in source.named_tensors())


def _worker(rank: int, world: int, port: int, model_dir: str, repeats: int, out: str, sizes: list) -> None:
    init_distributed(rank, world, master_port=port)
    try:
        model = PolicyTrainer(model_dir, TrainConfig()).model
        device = next(model.parameters()).device
        ways = {
            "per_parameter": lambda: per_parameter(model),
            "fsdp_unshard": lambda: fsdp_unshard(model),
            **{f"bucketed_{mb:g}mb": lambda mb=mb: source(model, gather_mb=mb) for mb in sizes},
            **{f"bucketed_bf16_{mb:g}mb": lambda mb=mb: source(model, torch.bfloat16, mb) for mb in sizes},
        }
        seconds: dict[str, list[float]] = {name: [] for name in ways}
        with torch.no_grad():
            for repeat in range(repeats + 1):
                for name, way in ways.items():  # alternating: the machine's load hits every way alike
                    dist.barrier()
                    begin = time.perf_counter()
                    way()
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    if repeat:
                        seconds[name].append(time.perf_counter() - begin)
        if rank == 0:
            result = {
                "device": str(device),
                "world": world,
                "bytes_fp32": sum(p.numel() * 4 for p in model.parameters()),
                "median_s": {name: round(statistics.median(s), 4) for name, s in seconds.items()},
                "seconds": {name: [round(x, 4) for x in s] for name, s in seconds.items()},
            }
            Path(out).write_text(json.dumps(result, indent=2))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--gather-mb", default="16,64,256", help="ModuleSource gather_bytes to try, MB")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="rf-gather-bench-") as temp:
        model = make_tiny_model(
            Path(temp) / "model", hidden_size=args.hidden, num_hidden_layers=args.layers,
            intermediate_size=4 * args.hidden, num_attention_heads=max(4, args.hidden // 128),
            num_key_value_heads=max(2, args.hidden // 512), head_dim=128 if args.hidden >= 1024 else args.hidden // 4,
        )  # fmt: skip
        out = Path(temp) / "result.json"
        sizes = [float(x) for x in args.gather_mb.split(",")]
        mp.spawn(_worker, args=(2, free_port(), str(model), args.repeats, str(out), sizes), nprocs=2)
        result = {"args": vars(args), **json.loads(out.read_text())}
    print(json.dumps(result, indent=2))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "source_gather.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
