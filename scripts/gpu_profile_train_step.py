"""Where a GRPO train step's time goes on one GPU, and AdamW's foreach form against the fused one the
trainer builds, in one run:

    python scripts/gpu_profile_train_step.py [--prompts 16 --n 8 --new-tokens 32] [--micro-batch-size 128]
                                              [--compile]     (train.compile: run it again with, to compare)

The trainer the loop runs (`PolicyTrainer`, FSDP2 over a world of one, bf16 compute over fp32 master
weights) on the benches' 2.08B Qwen3 shape (vocab 151,936; written to --model-path once), a synthetic
batch of the step's shape (prompts of --prompt-tokens, every sample --new-tokens long, advantages of
both signs). Printed as JSON lines (also to $OUT/train-step-profile.json), the device's work waited for:
- the step's wall time, median of --repeats after two warm-up steps, with AdamW's foreach form and then
  as the trainer builds it (fused on a GPU; the same hyper-parameters, its state started afresh);
- one step under torch.profiler: the ops by device time and by host time (tables in
  $OUT/train-step-profile.txt), so the forward, backward, the head's log-probs, the gradient clip and
  the optimizer can be told apart.
On the CPU (`--device cpu --tiny`) it runs a tiny model, to check the script itself.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, ".")

from rollfleet.config import TrainConfig  # noqa: E402
from rollfleet.train.fsdp import PolicyTrainer, adamw  # noqa: E402
from rollfleet.train.sharding import init_distributed  # noqa: E402
from rollfleet.wire.net import free_port  # noqa: E402

REPORT: list[dict] = []


def say(**line) -> None:
    REPORT.append(line)
    print(json.dumps(line), flush=True)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", default="/tmp/rollfleet-2b")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="a tiny model in a temporary directory (CPU check)")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=6, help="the bench's prompts: about 6 tokens")
    parser.add_argument("--micro-batch-size", type=int, default=128, help="the memory plan's rows at 16 x 8 x 32")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--compile", action="store_true", help="train.compile: each decoder layer's forward compiled")
    return parser.parse_args()


def model_dir(args) -> str:
    if args.tiny:
        from rollfleet.tiny_models import make_tiny_model

        return str(make_tiny_model(Path(tempfile.mkdtemp(prefix="rf-train-profile-")) / "model", seed=1))
    from rollfleet.bench.shapes import write_model

    return str(write_model(Path(args.model_path), 2048, 24, torch.bfloat16))


def batch_of(args, vocab: int) -> list[dict]:
    generator = torch.Generator().manual_seed(0)
    items = []
    for index in range(args.prompts * args.n):
        prompt = torch.randint(3, vocab, (args.prompt_tokens,), generator=generator).tolist()
        output = torch.randint(3, vocab, (args.new_tokens,), generator=generator).tolist()
        items.append(
            {
                "prompt_ids": prompt,
                "output_ids": output,
                "logprobs": [-2.0] * args.new_tokens,
                "advantage": 1.0 if index % 2 else -1.0,
            }
        )
    return items


def timed_steps(trainer: PolicyTrainer, batch: list[dict], repeats: int) -> list[float]:
    seconds = []
    for _ in range(repeats):
        sync(trainer.device)
        start = time.perf_counter()
        trainer.train_step(batch)
        sync(trainer.device)
        seconds.append(time.perf_counter() - start)
    return seconds


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profiled_step(trainer: PolicyTrainer, batch: list[dict], out: Path) -> None:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if trainer.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        trainer.train_step(batch)
        sync(trainer.device)
    averages = prof.key_averages()
    by_device = "self_cuda_time_total" if trainer.device.type == "cuda" else "self_cpu_time_total"
    text = "by device time\n" + averages.table(sort_by=by_device, row_limit=30)
    text += "\nby host time\n" + averages.table(sort_by="self_cpu_time_total", row_limit=20)
    (out / "train-step-profile.txt").write_text(text)
    print(text[:6000], flush=True)


def main() -> None:
    args = parse_args()
    out = Path(os.environ.get("OUT", tempfile.mkdtemp(prefix="rf-train-profile-out-")))
    out.mkdir(parents=True, exist_ok=True)
    path = model_dir(args)
    init_distributed(0, 1, master_port=free_port(), backend="nccl" if args.device == "cuda" else "gloo")
    device = torch.device(args.device)
    mixed = "bf16" if device.type == "cuda" else "fp32"
    config = TrainConfig(micro_batch_size=args.micro_batch_size, mixed_precision=mixed, compile=args.compile)
    trainer = PolicyTrainer(path, config, device=device)
    batch = batch_of(args, trainer.model.config.vocab_size)
    rows = args.prompts * args.n
    shape = {"rows": rows, "width": args.prompt_tokens + args.new_tokens, "micro_batch_size": args.micro_batch_size}
    shape["compile"] = args.compile  # the warm-up steps compile
    for name in ("foreach", "as built"):  # the same hyper-parameters; as built: fused on a GPU
        trainer.optimizer = adamw(
            trainer.model, config, **({"fused": False, "foreach": True} if name == "foreach" else {})
        )
        timed_steps(trainer, batch, 2)  # warm-up: the optimizer's state, the allocator's blocks
        seconds = timed_steps(trainer, batch, args.repeats)
        say(optimizer=name, **shape, step_s=statistics.median(seconds), min_s=min(seconds), max_s=max(seconds))
    profiled_step(trainer, batch, out)
    (out / "train-step-profile.json").write_text(json.dumps(REPORT, indent=1))


if __name__ == "__main__":
    main()
