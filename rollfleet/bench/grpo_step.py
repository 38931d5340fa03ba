"""Seconds per phase of a real GRPO step, each beside its ceiling measured in the same run.

    rollfleet bench grpo-step [--runs colocated,disaggregated] [--max-staleness 0,1,2] [--step small|large]
                              [--steps 8] [--json F]

Runs `rollfleet train` (a separate process, the real loop) on a Qwen3-shaped model written in bf16
(rollfleet.bench.shapes; default: hidden 2048, 24 layers, vocab 151,936: 2.08B parameters; `--vocab
320` gives the step-time issue's 1.46B model with the tiny test tokenizer), 16 prompts x n=8 x 32 new
tokens (`--step large`: 64 x 8 x 512 at train.micro_batch_size=16, a realistic step, with
examples/gpu-1x.yaml's micro batch: at 32 the trainer's turn needs 98 GB, which an 80 GB GPU's plan
refuses), in up to two layouts:
- colocated: trainer world 2, two tp=1 engines, one per GPU, `tensor` sync, 2048 MB buckets (on one
  GPU, `--gpus 1`: trainer world 1 beside one engine; the all-gather ceiling is then one copy);
- disaggregated: trainer world 1 on GPU 0, one engine on GPU 1, `nccl` sync; once per
  `--max-staleness` k (runs named disaggregated, disaggregated-k1, ...: k >= 1 generates the next
  steps' samples while the trainer trains). Each asynchronous run's step time is set against
  max(generate, train + sync) of the synchronous run (the best overlap can do; the issue's target is
  1.1 x that), or of its own figures without one.

Each phase's figure is the median over the steps after the first `--skip` (steady state). The
ceilings, measured afterwards on the same machine with the run's own byte counts:
- colocated sync: an all-gather of the weights over the trainer's two devices plus a same-device
  copy of them (what the sync must at least do when every rank feeds its own GPU's engines);
- disaggregated sync: plain broadcasts of the same bytes in the same buckets to a bare receiver;
- sleep/wake: pinned host<->device copies of the bytes the step moved (GPU only); beside it, what
  the turn adds for the engines' decode CUDA graphs (`engine_graph_capture_seconds`: the release
  drops them, the next generate captures them again).
On CPU the same runs work with gloo (slow, for checking the script); the pinned ceiling is skipped.
Beside the phases, the summary keeps the sync's split (`sync/<phase>`, from the step metrics'
`sync_phases`): where a sync that misses its ceiling spends its time. Each run's record holds the
memory plan its colocated GPUs ran with (`memory_plan`, the run's memory-plan.json; None where
nothing was planned: disaggregated, CPU). Buckets of 2048 MB are asked of the transports that take
buckets (not of `--set weight_sync.transport=lora`, which sends one adapter).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import get_args

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rollfleet.bench.raw_ceiling import raw_broadcast
from rollfleet.bench.record import command_line, make_record, run_echoing, spread, start, write_record
from rollfleet.bench.shapes import add_vocab_flag, write_model
from rollfleet.config.weight_sync import WeightSyncConfig
from rollfleet.train.host_copy import pinned_copy_ceiling
from rollfleet.wire.net import free_port

STEPS = {  # --step: prompts, samples per prompt, new tokens, train.micro_batch_size (None: the config's)
    "small": (16, 8, 32, None),
    "large": (64, 8, 512, 16),
}
PLAN_FILE = "memory-plan.json"  # what `rollfleet train` writes of a colocated GPU run's memory plan
PHASES = ("generate", "reward", "train", "sync", "sleep_wake", "recovery", "other", "total")
LAYOUTS = {
    "colocated": [
        "rollout.num_engines=2",
        "rollout.placement=colocated",
        "rollout.gpus_per_worker=0.5",
        "trainer.world_size=2",
        "weight_sync.transport=tensor",
    ],
    "disaggregated": [
        "rollout.num_engines=1",
        "rollout.placement=disaggregated",
        "trainer.world_size=1",
        "weight_sync.transport=nccl",
    ],
}


def layout_overrides(layout: str, gpus: int) -> list[str]:
    """The layout's settings; colocated on one GPU: one trainer rank beside one engine."""
    if gpus == 1 and layout == "disaggregated":
        raise SystemExit("--runs disaggregated needs 2 GPUs (the trainer on one, the engine on the other)")
    if gpus == 1:
        return [*LAYOUTS[layout], "rollout.num_engines=1", "trainer.world_size=1"]
    return LAYOUTS[layout]


def planned_runs(layouts: str, staleness: str) -> dict[str, tuple[str, int]]:
    """Run name -> (layout, grpo.max_staleness): colocated once (k >= 1 is refused there, the GPUs are
    shared), disaggregated once per k."""
    ks = [int(k) for k in staleness.split(",")]
    runs = {}
    for layout in layouts.split(","):
        for k in [0] if layout == "colocated" else ks:
            runs[layout if k == 0 else f"{layout}-k{k}"] = (layout, k)
    return runs


def bucket_overrides(overrides: list[str]) -> list[str]:
    """2048 MB buckets when the run's transport (the last weight_sync.transport set) takes buckets."""
    transport = [o.split("=", 1)[1] for o in overrides if o.startswith("weight_sync.transport=")][-1:]
    members = {m.model_fields["transport"].default: m for m in get_args(get_args(WeightSyncConfig)[0])}
    member = members.get(transport[0].strip() if transport else "disk")
    return ["weight_sync.bucket_mb=2048"] if member is not None and "bucket_mb" in member.model_fields else []


def run_layout(name: str, model: Path, out: Path, args, gpu: bool, layout: str | None = None, k: int = 0) -> dict:
    """One `rollfleet train` run; returns its metrics rows (or the failure and the log's tail) and
    the memory plan it ran with."""
    run_dir = out / f"run-{name}"
    log = out / f"{name}.log"
    chosen = [*layout_overrides(layout or name, args.gpus), f"grpo.max_staleness={k}", *args.set]
    micro_batch = STEPS[args.step][3]
    overrides = [
        f"rollout.model_path={model}",
        f"rollout.use_gpu={'true' if gpu else 'false'}",
        f"grpo.steps={args.steps}",
        f"grpo.prompts_per_step={args.prompts}",
        f"rollout.sampling.n={args.n}",
        f"rollout.sampling.max_new_tokens={args.new_tokens}",
        *([f"train.micro_batch_size={micro_batch}"] if micro_batch else []),
        *bucket_overrides(chosen),
        f"grpo.output_dir={run_dir}",
        "grpo.final_checkpoint=false",  # the steps are timed; the 2B trainer state would be 25 GB to write
        f"ray.num_cpus={max(4, os.cpu_count() or 4)}",
        *chosen,
    ]
    command = [sys.executable, "-m", "rollfleet", "train", args.config, *overrides]
    began = time.perf_counter()
    with open(log, "w") as handle:
        code = run_echoing(command, handle, args.run_timeout_s, prefix=f"{name}: ")
    metrics = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] if metrics.exists() else []
    result = {"command": " ".join(command[2:]), "exit_code": code, "wall_s": time.perf_counter() - began, "rows": rows}
    plan = run_dir / PLAN_FILE
    result["memory_plan"] = json.loads(plan.read_text()) if plan.exists() else None
    if code != 0 or len(rows) <= args.skip:
        result["log_tail"] = log.read_text()[-3000:]
    return result


def steady(rows: list[dict], skip: int) -> dict:
    """Median of each phase (and of the byte counts) over the steps after `skip`."""
    kept = rows[skip:]
    figures = {p: statistics.median(r.get(f"time/{p}", 0.0) for r in kept) for p in PHASES}
    steady_keys = ("sleep_wake_gbps", "sleep_wake_ceiling_gbps", "generate_busy_seconds", "staleness_mean", "overlap")
    steady_keys += ("engine_graph_capture_seconds", "engine_graph_captures")  # what a colocated turn adds for graphs
    for key in ("sync_bytes", "sleep_wake_bytes", *steady_keys):
        values = [r[key] for r in kept if isinstance(r.get(key), (int, float))]
        if values:
            figures[key] = statistics.median(values)
    for key in sorted({k for r in kept for k in r if k.startswith("sync_phases/")}):  # where the sync went
        figures[key.replace("sync_phases/", "sync/")] = statistics.median(r.get(key, 0.0) for r in kept)
    figures["sync/sender"] = statistics.median(r.get("sync_seconds", 0.0) for r in kept)
    figures["steps"] = len(kept)
    return figures


def async_ratios(results: dict[str, dict]) -> dict[str, dict]:
    """Each asynchronous run's step time against the best overlap can do: max(generate, train + sync)
    of the synchronous disaggregated run (its own generating time and train + sync without one)."""
    out = {}
    base = results.get("disaggregated")
    for name, figures in results.items():
        if "-k" not in name or "total" not in figures:
            continue
        if base and "total" in base:
            bound, against = max(base["generate"], base["train"] + base["sync"]), "disaggregated"
        else:
            bound, against = max(figures.get("generate_busy_seconds", 0.0), figures["train"] + figures["sync"]), name
        out[name] = {"step_s": figures["total"], "bound_s": bound, "ratio": figures["total"] / bound, "of": against}
        if base and "total" in base:
            out[name]["speedup_vs_sync"] = base["total"] / figures["total"]
    return out


# ---- ceilings ---------------------------------------------------------------------------------------
def _allgather_rank(rank: int, world: int, port: int, nbytes: int, repeats: int, gpu: bool, queue) -> None:
    device = torch.device(f"cuda:{rank}") if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if gpu else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=120),
    )
    shard = nbytes // world
    mine = torch.ones(shard, dtype=torch.uint8, device=device)
    full = torch.empty(shard * world, dtype=torch.uint8, device=device)
    engine = torch.empty_like(full)  # the engine's parameters on the same device
    times = []
    for _ in range(1 + repeats):
        dist.barrier()
        if gpu:
            torch.cuda.synchronize(device)
        begin = time.perf_counter()
        dist.all_gather_into_tensor(full, mine)
        engine.copy_(full)
        if gpu:
            torch.cuda.synchronize(device)
        dist.barrier()
        times.append(time.perf_counter() - begin)
    if rank == 0:
        queue.put(times[1:])
    dist.destroy_process_group()


def allgather_copy_ceiling(nbytes: int, repeats: int, gpu: bool, world: int = 2) -> list[float]:
    """Seconds of an all-gather of `nbytes` over `world` devices plus a same-device copy (warm)."""
    context = mp.get_context("spawn")
    queue, port = context.Queue(), free_port()
    procs = [
        context.Process(target=_allgather_rank, args=(r, world, port, nbytes, repeats, gpu, queue))
        for r in range(world)
    ]
    for proc in procs:
        proc.start()
    times = queue.get(timeout=600)
    for proc in procs:
        proc.join(timeout=120)
    return times


def broadcast_ceiling(nbytes: int, bucket_bytes: int, repeats: int, gpu: bool) -> list[float]:
    sender = "cuda:0" if gpu else "cpu"
    sizes = [min(bucket_bytes, nbytes - offset) for offset in range(0, nbytes, bucket_bytes)]
    buckets = [torch.ones(size, dtype=torch.uint8, device=sender) for size in sizes]
    figures = raw_broadcast(buckets, repeats, sender, "cuda:1" if gpu else "cpu", "nccl" if gpu else "gloo")
    return figures["timed"]


def ceilings(results: dict[str, dict], repeats: int, gpu: bool, gpus: int = 2) -> dict[str, dict]:
    out: dict[str, dict] = {}
    if "colocated" in results and results["colocated"].get("sync_bytes"):
        nbytes = int(results["colocated"]["sync_bytes"])
        times = allgather_copy_ceiling(nbytes, repeats, gpu, world=gpus)
        what = f"all-gather over {gpus} device(s) + same-device copy"
        out["colocated_sync"] = {"what": what, "bytes": nbytes, **spread(times)}
    if "disaggregated" in results and results["disaggregated"].get("sync_bytes"):
        nbytes = int(results["disaggregated"]["sync_bytes"])
        times = broadcast_ceiling(nbytes, 2048 << 20, repeats, gpu)
        out["disaggregated_sync"] = {"what": "raw broadcast, 2048 MB buckets", "bytes": nbytes, **spread(times)}
    if gpu:  # the same measurement the run's log shows beside sleep/wake (rollfleet.train.host_copy)
        moved = max((int(r.get("sleep_wake_bytes") or 0) for r in results.values()), default=0)
        out["pinned_copy_gb_per_s"] = pinned_copy_ceiling(moved or 4 << 30, "cuda:0", repeats=repeats)
    return out


def table(results: dict[str, dict], limits: dict[str, dict]) -> str:
    """One line per layout: each phase's median seconds; sync and sleep/wake beside their ceilings."""
    lines = ["| run | " + " | ".join(PHASES) + " | sync ceiling s | sync / ceiling | sleep/wake GB/s | pinned GB/s |"]
    lines.append("|---" * (len(PHASES) + 5) + "|")
    pinned = limits.get("pinned_copy_gb_per_s")
    for name, figures in results.items():
        if "total" not in figures:
            lines.append(f"| {name} | failed: see the record |")
            continue
        limit = limits.get(f"{name}_sync", {}).get("median")
        ratio = f"{limit / figures['sync']:.2f}" if limit and figures["sync"] else "-"
        moved = figures.get("sleep_wake_bytes")
        rate = f"{moved / figures['sleep_wake'] / 1e9:.1f}" if moved and figures["sleep_wake"] else "-"
        cells = " | ".join(f"{figures[p]:.2f}" for p in PHASES)
        pinned_text = f"{pinned['d2h_gbps']:.1f} / {pinned['h2d_gbps']:.1f}" if pinned else "-"
        lines.append(f"| {name} | {cells} | {limit or 0:.3f} | {ratio} | {rate} | {pinned_text} |")
    return "\n".join(lines)


def parse(argv: list[str] | None):
    p = argparse.ArgumentParser(prog="rollfleet bench grpo-step", description=__doc__.split("\n")[0])
    p.add_argument("--runs", default="colocated,disaggregated")
    p.add_argument("--max-staleness", default="0", help="grpo.max_staleness of the disaggregated runs, e.g. 0,1,2")
    p.add_argument("--config", default="examples/cpu-demo.yaml")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=24)
    add_vocab_flag(p)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--skip", type=int, default=2, help="first steps left out of the medians (warm-up)")
    p.add_argument("--step", choices=sorted(STEPS), default="small", help="small: 16 x 8 x 32; large: 64 x 8 x 512")
    p.add_argument("--prompts", type=int, default=None, help="prompts per step (default: --step's)")
    p.add_argument("--n", type=int, default=None, help="samples per prompt (default: --step's)")
    p.add_argument("--new-tokens", type=int, default=None, help="new tokens per sample (default: --step's)")
    p.add_argument("--repeats", type=int, default=5, help="timed passes of each ceiling")
    p.add_argument("--run-timeout-s", type=float, default=280)
    p.add_argument("--gpus", type=int, default=0, help="GPUs to lay the runs on (0: up to 2 that are there)")
    p.add_argument("--set", action="append", default=[], help="extra config override, key.path=value")
    p.add_argument("--out", default="runs/grpo-step", help="work folder (the model, the runs); $WORK in the record")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    prompts, n, new_tokens, _ = STEPS[args.step]
    args.prompts, args.n = args.prompts or prompts, args.n or n
    args.new_tokens = new_tokens if args.new_tokens is None else args.new_tokens
    return args


def main(argv: list[str] | None = None) -> None:
    args, started = parse(argv), start()
    gpu = torch.cuda.is_available()
    args.gpus = args.gpus or (min(2, torch.cuda.device_count()) if gpu else 2)  # CPU: two gloo ranks
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dtype = torch.bfloat16 if gpu else torch.float32
    name = f"qwen3-h{args.hidden}-l{args.layers}-v{args.vocab}"
    model = write_model(out / name, args.hidden, args.layers, dtype, args.vocab)
    planned = planned_runs(args.runs, args.max_staleness)
    runs = {name: run_layout(name, model, out, args, gpu, layout, k) for name, (layout, k) in planned.items()}
    results = {name: steady(run["rows"], args.skip) for name, run in runs.items() if len(run["rows"]) > args.skip}
    limits = ceilings(results, args.repeats, gpu, args.gpus)
    ratios = async_ratios(results)
    text = table({name: results.get(name, {}) for name in runs}, limits)
    for name, r in ratios.items():
        text += f"\n{name}: step {r['step_s']:.2f} s = {r['ratio']:.2f} x max(generate, train + sync) of {r['of']}"
    print(text)
    settings = {k: v for k, v in vars(args).items() if k != "json"}  # --json: a path of the measuring machine
    model_bytes = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    ok = all(run["exit_code"] == 0 for run in runs.values()) and len(results) == len(runs)
    record = make_record(
        "grpo-step",
        command_line(["rollfleet", "bench", "grpo-step"], argv),
        {**settings, "gpu": gpu, "dtype": str(dtype), "model_bytes": model_bytes},
        [{"run": name, **run} for name, run in runs.items()],
        {"phases": results, "ceilings": limits, "async": ratios, "table": text},
        ok,
        None if ok else "a run failed or recorded too few steps (see repeats[].log_tail)",
        started,
    )
    text = json.dumps(record).replace(str(out.resolve()), "$WORK").replace(str(out), "$WORK")
    write_record(args.json, json.loads(text))  # the work folder is a path of this machine
    if not ok:
        sys.exit(1)
