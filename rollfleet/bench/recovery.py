"""Time from an engine's death to ACTIVE again, split into detect, restart, restore and verify.

    rollfleet bench recovery [--hidden 2048 --layers 24 --dtype bfloat16 --repeats 3 --json F]

A local Ray fleet of two embedded engines (CPU, or GPUs when present) holds weights of version v1
(pushed over disk, so a checkpoint exists). Six ways back: one engine restored from the disk
checkpoint; one engine restored by a trainer push (tensor transport); one engine restored from its
peer (R-Fork pull from the other engine, rollfleet.fleet.peer_restore); two engines restored from
the same checkpoint, each reading the files vs reading them once and fanning out (tensor transport);
and, on a second fleet of two engines and one warm standby (rollfleet.fleet.standby), a standby
taking the dead engine's place, restored from the peer: no restart on the critical path (`restart`
0; `setup` is the role swap; the dead slot restarts as the new standby afterwards, untimed). The
standby lives on a GPU of its own with 3 GPUs or more, else beside engine 1 on its GPU (memory split
0.45 / 0.45); `--standby-layout own|beside` chooses. Restarts fork from the workers' zygotes
(`--launcher spawn` measures a plain spawn instead).

The phases are the fleet's own steps, timed apart: `restore` is the load (or the send; for the peer
path the pull, with the seed's fingerprints read first), `verify` the fleet's fingerprint check
(fleet.verify), `expected` computing the fingerprints expected from the checkpoint's files, and
`setup` building, connecting and tearing down a transport (push and fan-out only). `total` (kill to
ACTIVE) is the sum of all of them.

`restart` is split again by the restarted engine itself (its /get_server_info "start_breakdown",
engine/process/start_timing.py; the slowest engine when two restart): spawn, imports, model code, device and
process group, model build (construction + weight allocation), tokenizer, server set-up, listening;
`outside` is the rest of `restart` (stopping the dead process, Ray calls, seeing the engine up).

On one GPU the fleet has one engine and only the single-engine paths run (disk checkpoint, trainer
push); the paths that need a second engine on a GPU of its own (peer, two engines, standby: NCCL
needs the two ends on different devices) are named as skipped before the run, in its output and in
the record (`config.skipped_paths`). The model is the benchmarks' shape (rollfleet.bench.shapes)
with a 151,936-token vocabulary by default (`--vocab`).
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

from rollfleet.bench.record import command_line, make_record, spread, start, write_record
from rollfleet.bench.shapes import add_vocab_flag, write_model
from rollfleet.config import TensorSync, load_config
from rollfleet.fleet.fleet import Fleet
from rollfleet.fleet.placement import init_local_ray
from rollfleet.weights.checkpoint import CheckpointSource
from rollfleet.weights.source import ModuleSource
from rollfleet.weights.transports import make_transport

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
PHASES = ("detect", "restart", "setup", "restore", "expected", "verify")
PATHS = (
    "1 engine, disk checkpoint",
    "1 engine, trainer push (tensor)",
    "1 engine, restart + peer",
    "2 engines, each reads the files",
    "2 engines, read once + fan-out (tensor)",
    "standby + peer",
)
STANDBY_PATH = PATHS[-1]
SINGLE_ENGINE_PATHS = PATHS[:2]  # what one GPU can run: the fleet's only engine dies and comes back


def planned_paths(gpus: int) -> tuple[tuple[str, ...], dict[str, str]]:
    """The paths this machine runs, and those it skips with why (gpus 0: CPU, every path)."""
    if gpus == 1:
        why = "needs 2 GPUs: a second engine on a GPU of its own"
        return SINGLE_ENGINE_PATHS, {path: why for path in PATHS if path not in SINGLE_ENGINE_PATHS}
    return PATHS, {}


def _kill_and_restart(fleet: Fleet, engine_ids: list[int]) -> tuple[dict[str, float], dict[str, float]]:
    """Phase times, and the restart's split by the slowest restarted engine's own start breakdown."""
    start = time.perf_counter()
    for engine_id in engine_ids:
        os.killpg(ray.get(fleet.slots[engine_id].head.engine_pid.remote()), signal.SIGKILL)
    while any(fleet.slots[e].state.value != "INACTIVE" for e in engine_ids):
        time.sleep(0.005)
    detected = time.perf_counter()
    fleet.restart_inactive(restore=False)
    times = {"detect": detected - start, "restart": time.perf_counter() - detected}
    infos = fleet.pool.on_all("get_server_info", engine_ids)
    slowest = max((info.get("start_breakdown") or {"total_s": 0.0} for info in infos), key=lambda b: b["total_s"])
    split = {**slowest.get("phases", {}), "outside": max(0.0, times["restart"] - slowest["total_s"])}
    print(f"  restart of {engine_ids}: {times['restart']:.2f} s, launched by {slowest.get('launch', 'spawn')}")
    return times, split


def _timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def _push(fleet: Fleet, source, version: str, engine_ids: list[int]) -> dict[str, float]:
    """fleet.sync_weights over tensor, its steps timed apart: set-up and teardown, send, verify."""
    setup, transport = _timed(lambda: make_transport(TensorSync(), fleet.weight_targets(engine_ids)))
    connect, _ = _timed(transport.connect)
    try:
        restore, report = _timed(lambda: transport.send(source, version))
    finally:
        teardown, _ = _timed(transport.disconnect)
    verify, _ = _timed(lambda: fleet.verify(report, advance=False))
    return {"setup": setup + connect + teardown, "restore": restore, "verify": verify}


def _from_disk(fleet: Fleet, checkpoint: str, version: str, engine_ids: list[int]) -> dict[str, float]:
    """fleet.update_weights_from_disk, its steps timed apart: load, expected fingerprints, verify."""
    restore, _ = _timed(
        lambda: fleet.pool.on_all("update_weights_from_disk", engine_ids, checkpoint, weight_version=version)
    )
    seconds, report = _timed(lambda: fleet.expected_from_checkpoint(checkpoint, version, engine_ids))
    verify, _ = _timed(lambda: fleet.verify(report, advance=False))
    return {"restore": restore, "expected": seconds, "verify": verify}


def _from_peer(fleet: Fleet, version: str, engine_ids: list[int]) -> tuple[dict[str, float], dict[str, float]]:
    """The fleet's peer restore (the source Recovery tries first), then fleet.verify of its report;
    and the slowest destination's own split of its pull (layout, join, transfer, check)."""
    slots = [fleet.slots[e] for e in engine_ids]
    restore, report = _timed(lambda: fleet.recovery.peer.restore(slots, version, time.monotonic() + 120))
    assert not report.failed, f"peer restore failed: {report.failed}"
    verify, _ = _timed(lambda: fleet.verify(report, advance=False))
    loads = [
        info["rollfleet_remote_instance"]["last_load"] for info in fleet.pool.on_all("get_server_info", engine_ids)
    ]
    slowest = max(loads, key=lambda load: load.get("seconds", 0.0))
    split = {**slowest.get("phases", {}), "outside": max(0.0, restore - slowest.get("seconds", 0.0))}
    print(f"  peer pull of {engine_ids}: " + ", ".join(f"{k} {v:.3f} s" for k, v in split.items()))
    return {"restore": restore, "verify": verify}, split


def _one_round(fleet: Fleet, model, checkpoint: str, paths: tuple[str, ...]) -> list[dict]:
    rows, last = [], len(fleet.slots) - 1
    for path in [p for p in paths if p != STANDBY_PATH]:  # the standby path runs on a fleet of its own
        engines = [last] if path.startswith("1 engine") else [0, 1]
        times, start_split = _kill_and_restart(fleet, engines)
        pull_split = {}
        if path in (PATHS[0], PATHS[3]):
            times |= _from_disk(fleet, checkpoint, "v1", engines)
        elif path == PATHS[1]:
            times |= _push(fleet, ModuleSource(model), "v1", engines)
        elif path == PATHS[2]:
            peer, pull_split = _from_peer(fleet, "v1", engines)
            times |= peer
        else:
            times |= _push(fleet, CheckpointSource(checkpoint), "v1", engines)
        states = [s.state.value for s in fleet.slots]
        assert states == ["ACTIVE"] * len(fleet.slots), f"{path}: engines {states} after recovery"
        row = {"path": path, **{k: times.get(k, 0.0) for k in PHASES}, "total": sum(times.values())}
        rows.append({**row, "restart_split": start_split, "pull_split": pull_split})
    return rows


def _standby_round(fleet: Fleet) -> dict:
    """Kill a serving engine; a standby takes its place (role swap), restored from the peer and
    verified; then the dead slot restarts as the new standby (untimed: not on the critical path)."""
    standby = next(s for s in fleet.slots if s.standby)
    serving = [s for s in fleet.slots if s.state.value == "ACTIVE"]
    # the engine sharing the standby's GPU (if any) dies: the standby then pulls from a peer on another
    # GPU (an engine on its own GPU cannot seed it over NCCL; the fleet never picks one)
    victim = next((s for s in serving if set(s.gpu_ids) & set(standby.gpu_ids)), serving[0]).engine_id
    start = time.perf_counter()
    os.killpg(ray.get(fleet.slots[victim].head.engine_pid.remote()), signal.SIGKILL)
    while fleet.slots[victim].state.value != "INACTIVE":
        time.sleep(0.005)
    times = {"detect": time.perf_counter() - start}
    times["setup"], promoted = _timed(fleet.recovery.promote_standbys)
    assert len(promoted) == 1, f"no standby took engine {victim}'s place"
    peer, pull_split = _from_peer(fleet, "v1", [promoted[0].engine_id])
    times |= peer
    fleet.restart_inactive(restore=False)
    roles = sorted((s.state.value, s.standby) for s in fleet.slots)
    serving = len(fleet.slots) - 1
    assert roles == [("ACTIVE", False)] * serving + [("AWAITING_WEIGHTS", True)], f"after the take-over: {roles}"
    row = {"path": STANDBY_PATH, **{k: times.get(k, 0.0) for k in PHASES}, "total": sum(times.values())}
    return {**row, "restart_split": {}, "pull_split": pull_split}


def _model(args, scratch: Path) -> Path:
    return write_model(scratch / "model", args.hidden, args.layers, DTYPES[args.dtype], args.vocab)


BESIDE = ["rollout.standby_beside=[1]", "rollout.mem_fraction_static=0.45", "rollout.standby_mem_fraction_static=0.45"]


def _fleet(
    model_dir: Path, scratch: Path, launcher: str, standby_engines: int = 0, beside: bool = False, engines: int = 2
) -> Fleet:
    overrides = [
        *(BESIDE if beside else []),
        f"rollout.engine_launcher={launcher}",
        f"rollout.model_path={model_dir}",
        "rollout.use_gpu=true",
        f"rollout.num_engines={engines}",
        f"rollout.standby_engines={standby_engines}",
        "rollout.auto_restart=false",  # the benchmark times each restart itself
        f"rollout.log_dir={scratch}/logs",
        "weight_sync.transport=disk",
        f"weight_sync.path={scratch}/sync",
    ]
    return Fleet.from_config(load_config(None, overrides))


def _rounds(fleet: Fleet, model_dir: Path, args, one_round) -> tuple[list[dict], str]:
    """Push v1 (a perturbed copy of the model: not what a dummy start holds), then the rounds."""
    try:
        # on a GPU where there is one, as a trainer's tensors are: a host-resident model made the
        # push path a host-to-device copy (1.1-1.3 s for 2.9 GB on H200, against ~0.15 s from a GPU)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[args.dtype]).to(device)
        with torch.no_grad():
            for param in model.parameters():
                param.add_(1e-3)
        fleet.sync_weights(ModuleSource(model), "v1", config_dir=str(model_dir))
        checkpoint = fleet.checkpoint_for("v1")
        rows = []
        for repeat in range(args.repeats):
            rows += [{"repeat": repeat + 1, **row} for row in one_round(fleet, model, checkpoint)]
        return rows, checkpoint
    finally:
        fleet.shutdown()


def _run(args, paths: tuple[str, ...]) -> tuple[list[dict], float, bool]:
    with tempfile.TemporaryDirectory(prefix="rf-bench-") as scratch:
        scratch = Path(scratch)
        model_dir, gpus = _model(args, scratch), torch.cuda.device_count()
        init_local_ray(num_cpus=8, num_gpus=gpus or 3, _temp_dir=str(scratch / "ray"))
        try:
            engines = 1 if gpus == 1 else 2
            fleet = _fleet(model_dir, scratch / "a", args.launcher, engines=engines)
            rows, checkpoint = _rounds(fleet, model_dir, args, lambda f, m, c: _one_round(f, m, c, paths))
            size_mb = sum(f.stat().st_size for f in Path(checkpoint).glob("*.safetensors")) / 1e6
            if STANDBY_PATH not in paths:
                return rows, size_mb, gpus > 0
            beside = args.standby_layout == "beside" or (args.standby_layout == "auto" and (gpus or 3) < 3)
            print(
                f"  {STANDBY_PATH}: the standby on {'engine 1' + chr(39) + 's GPU' if beside else 'a GPU of its own'}"
            )
            standby_fleet = _fleet(model_dir, scratch / "b", args.launcher, standby_engines=1, beside=beside)
            rows += _rounds(standby_fleet, model_dir, args, lambda f, m, c: [_standby_round(f)])[0]
        finally:
            ray.shutdown()
    return rows, size_mb, gpus > 0


def _summary(rows: list[dict], size_mb: float, gpu: bool) -> dict:
    per_path, splits, pulls = {}, {}, {}
    for path in PATHS:
        mine = [r for r in rows if r["path"] == path]
        if not mine:  # the standby path on a machine with too few GPUs
            continue
        per_path[path] = {k: spread([r[k] for r in mine]) for k in (*PHASES, "total")}
        names = dict.fromkeys(name for r in mine for name in r["restart_split"])  # start order
        splits[path] = {name: spread([r["restart_split"].get(name, 0.0) for r in mine]) for name in names}
        if names := dict.fromkeys(name for r in mine for name in r.get("pull_split", {})):
            pulls[path] = {name: spread([r["pull_split"].get(name, 0.0) for r in mine]) for name in names}
    summary = {"device": "GPU" if gpu else "CPU", "checkpoint_mb": size_mb, "paths": per_path, "restart_split": splits}
    return {**summary, "pull_split": pulls}


def _print_restart_split(summary: dict) -> None:
    """The restart column again, split by the engine's own start phases (medians, seconds)."""
    splits = summary["restart_split"]
    names = list(dict.fromkeys(name for split in splits.values() for name in split))
    print("  restart, split by the restarted engine's start breakdown (slowest engine; outside = not in the engine)")
    print(f"  {'path':40}" + "".join(f"{name[:11]:>12}" for name in names))
    for path, split in splits.items():
        if not split:  # no restart on this path (standby)
            continue
        print(f"  {path:40}" + "".join(f"{split[n]['median'] if n in split else 0.0:12.3f}" for n in names))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="rollfleet bench recovery")
    gpu = torch.cuda.is_available()
    parser.add_argument("--hidden", type=int, default=2048 if gpu else 256)
    parser.add_argument("--layers", type=int, default=24 if gpu else 8)
    parser.add_argument(
        "--dtype", choices=sorted(DTYPES), default="bfloat16" if gpu else "float32", help="of the weights"
    )
    add_vocab_flag(parser)
    parser.add_argument("--repeats", type=int, default=1, help="rounds of the six paths")
    parser.add_argument(
        "--standby-layout",
        choices=["auto", "own", "beside"],
        default="auto",
        help="where the standby lives: a GPU of its own, or beside engine 1 (auto: beside with fewer than 3 GPUs)",
    )
    parser.add_argument("--launcher", choices=["zygote", "spawn"], default="zygote", help="rollout.engine_launcher")
    parser.add_argument("--json", default=None, help="write the record (rollfleet/bench/record.py) to this file")
    args = parser.parse_args(argv)
    command, started = command_line(["rollfleet", "bench", "recovery"], argv), start()
    paths, skipped = planned_paths(torch.cuda.device_count())
    for path, why in skipped.items():
        print(f"  skipped on this machine: {path} ({why})", flush=True)
    rows, size_mb, gpu = _run(args, paths)
    summary = _summary(rows, size_mb, gpu)
    print(
        f"recovery, embedded engines on {summary['device']}, checkpoint {size_mb:.1f} MB, median of {args.repeats} "
        "(seconds; total = kill to ACTIVE, the sum of the phases)"
    )
    print(f"  {'path':40}" + "".join(f"{k:>9}" for k in (*PHASES, "total")))
    for path, figures in summary["paths"].items():
        print(f"  {path:40}" + "".join(f"{figures[k]['median']:9.3f}" for k in (*PHASES, "total")))
    _print_restart_split(summary)
    for path, split in summary["pull_split"].items():
        print(
            f"  {path}: the pull, split by the restored engine (median s): "
            + ", ".join(f"{name} {figures['median']:.3f}" for name, figures in split.items())
        )
    print("  targets on CPU: detect < 2 s, total < 20 s")
    config = {**{k: v for k, v in vars(args).items() if k != "json"}, "skipped_paths": skipped}
    write_record(args.json, make_record("recovery", command, config, rows, summary, True, started=started))


if __name__ == "__main__":
    main()
