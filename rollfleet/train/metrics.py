"""What a GRPO run records: seconds per phase of each step, one metrics line per step (metrics.jsonl
and TensorBoard), the console line, and the reward and loss curves (curves.png)."""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from pathlib import Path

from rollfleet.sample import Sample
from rollfleet.weights.transports import SyncReport

PHASES = ("generate", "reward", "train", "sync", "sleep_wake", "recovery")
TRAINER_MEMORY = ("allocated_before", "reserved_before", "allocated_after", "reserved_after")


class StepClock:
    """Seconds per phase of one step; 'other' is whatever no phase covered."""

    def __init__(self):
        self.start, self.phases = time.perf_counter(), dict.fromkeys(PHASES, 0.0)

    @contextmanager
    def phase(self, name: str):
        begin = time.perf_counter()
        try:
            yield
        finally:
            self.phases[name] += time.perf_counter() - begin

    def breakdown(self) -> dict[str, float]:
        total = time.perf_counter() - self.start
        return {**self.phases, "other": max(total - sum(self.phases.values()), 0.0), "total": total}


def step_metrics(
    samples: list[Sample],
    train: dict,
    report: SyncReport,
    events: list[dict],
    clock: StepClock,
    retries: int,
    *,
    sleep_wake: dict | None = None,
    recovery: dict | None = None,
) -> dict:
    """One step's metrics: rewards, lengths, the trainer's figures, the sync, engine events, the
    colocated memory moves (`sleep_wake`: Fleet.trainer_turn's `moves`), recovery snapshots, time."""
    rewards = [s.reward for s in samples]
    recovery = recovery or {}
    written = recovery.get("snapshots_written", [])
    return {
        "reward_mean": sum(rewards) / len(rewards),
        "reward_max": max(rewards),
        "exact": sum(r == 1.0 for r in rewards) / len(rewards),
        "response_tokens": sum(len(s.output_ids) for s in samples) / len(samples),
        "train": train,
        "sync_gb_per_s": report.gb_per_s,
        "sync_seconds": report.seconds,
        # where the sync's time went: the sender's phases (rank 0: source/gathers, pack, the engines'
        # answers, ...) and the fleet's verification, beside the step clock's whole sync phase
        "sync_phases": {**report.phases},
        # the tensor transport's resident path: "kept" (an id sent), "mapped to engines [...]", or why it packed
        "sync_resident": report.resident,
        "sync_tensors": report.tensors,
        "sync_bytes": report.bytes,
        "sync_verified_engines": len(report.verified),
        **sleep_wake_figures(sleep_wake or {}),
        "snapshot_skipped": recovery.get("snapshot_skipped", 0),
        # the host copy of each snapshot written (off the critical path: beside the engines' generate)
        "snapshot_copy_seconds": sum(w.get("copy_seconds", 0.0) for w in written) if written else None,
        "snapshot_write_seconds": sum(w["seconds"] for w in written) if written else None,
        "snapshot_versions_written": [w["version"] for w in written],
        "generate_retries": retries,
        "engine_failures": sum(e["to"] == "INACTIVE" for e in events),
        "engine_recoveries": sum(e["to"] == "ACTIVE" and e["why"].startswith("recovered") for e in events),
        "engine_events": events,
        "time": clock.breakdown(),
    }


def sleep_wake_figures(moves: dict, ceiling: dict | None = None) -> dict:
    """Bytes the trainer moved each way and at what rate; the engines' release/resume (they free and
    re-allocate device memory, no bytes cross to the host); with `ceiling` (pinned copy GB/s of the
    same bytes, rollfleet.train.host_copy.pinned_copy_ceiling) the rate it allows for these bytes."""
    onload, offload = moves.get("trainer_onload_bytes", 0), moves.get("trainer_offload_bytes", 0)
    onload_s, offload_s = moves.get("trainer_onload_seconds", 0.0), moves.get("trainer_offload_seconds", 0.0)
    moved, seconds = onload + offload, onload_s + offload_s
    figures = {
        "sleep_wake_bytes": moved,
        "sleep_wake_gbps": moved / seconds / 1e9 if moved and seconds else None,
        "trainer_onload_bytes": onload,
        "trainer_onload_seconds": onload_s,
        "trainer_offload_bytes": offload,
        "trainer_offload_seconds": offload_s,
        "engine_released_bytes": moves.get("engine_released_bytes", 0),
        "engine_release_seconds": moves.get("engine_release_seconds", 0.0),
        "engine_resume_seconds": moves.get("engine_resume_seconds", 0.0),
        # the trainers' end of turn as the driver waits for it: their offload (if any) and cache give-back
        "trainer_give_back_seconds": moves.get("trainer_give_back_seconds", 0.0),
        # decode graphs the release dropped, captured again in the step's generate (embedded engine, GPU)
        "engine_graph_captures": moves.get("engine_graph_captures"),
        "engine_graph_capture_seconds": moves.get("engine_graph_capture_seconds"),
        "sleep_wake_ceiling_gbps": None,
        # the trainer's (rank 0's) device memory around the end of its turn: the offload, then its
        # cached memory given back (PolicyTrainer.offload); None on CPU or without a colocated turn
        **{f"trainer_{key}_bytes": (moves.get("trainer_memory") or {}).get(key) for key in TRAINER_MEMORY},
    }
    if ceiling and moved:
        best_seconds = onload / (ceiling["h2d_gbps"] * 1e9) + offload / (ceiling["d2h_gbps"] * 1e9)
        figures["sleep_wake_ceiling_gbps"] = moved / best_seconds / 1e9
    return figures


class MetricsLog:
    def __init__(self, output_dir: Path, resume: bool):
        from torch.utils.tensorboard import SummaryWriter

        self.path = output_dir / "metrics.jsonl"
        if not resume:
            self.path.unlink(missing_ok=True)
        self.tensorboard = SummaryWriter(str(output_dir / "tensorboard"))

    def write(self, step: int, metrics: dict) -> None:
        """One line per step: nested figures flattened (train/loss), lists kept (engine_events)."""
        row = {**flatten(metrics), **{k: v for k, v in metrics.items() if isinstance(v, list)}}
        with open(self.path, "a") as handle:
            handle.write(json.dumps({"step": step, **row}) + "\n")
        for key, value in row.items():
            if isinstance(value, (int, float)):
                self.tensorboard.add_scalar(key, value, step)

    def rows(self) -> list[dict]:
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]

    def close(self) -> None:
        self.tensorboard.close()


def flatten(metrics: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in metrics.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}/"))
        elif not isinstance(value, list):
            out[f"{prefix}{key}"] = value
    return out


def console_line(step: int, steps: int, m: dict) -> str:
    t = m["time"]
    return (
        f"step {step:>4}/{steps}  reward {m['reward_mean']:.3f}  exact {m['exact']:.2f}  "
        f"loss {m['train']['loss']:+.4f}  mismatch {m['train']['logprob_mismatch_mean']:.1e}  "
        f"tis max {m['train']['tis_ratio_max']:.3f}  "
        f"[gen {t['generate']:.2f}s train {t['train']:.2f}s sync {t['sync']:.2f}s "
        f"sleep/wake {t['sleep_wake']:.2f}s other {t['other']:.2f}s]"
        + (
            f"  engines failed {m['engine_failures']}, recovered {m['engine_recoveries']}"
            if m["engine_failures"] or m["engine_recoveries"]
            else ""
        )
        + _moves_text(m)
        + _stream_text(m)
        + _episodes_text(m)
    )


def _episodes_text(m: dict) -> str:
    """Multi-turn episodes (grpo.environment): turns, the share of their time spent in tools, and of
    the rollout's wall time the share with a tool waited on and the share with only tools running."""
    if "episodes" not in m:
        return ""
    e = m["episodes"]
    text = f"  turns {e['turns_mean']:.2f}  tools {e['tool_wait_share']:.0%} of episode time"
    text += f"; of rollout wall time {e['tool_wall_share']:.0%} with a tool running, "
    text += f"{e['tool_only_wall_share']:.0%} with only tools running"
    rejected = e.get("episode_finish", {}).get("engine_rejected", 0)
    return text + (f"  {rejected} refused by the engine" if rejected else "")


def _stream_text(m: dict) -> str:
    """Samples made ahead or filtered (rollfleet.train.sample_stream): their staleness, the trainer's
    wait for them, the overlap of generation with training, what was dropped."""
    if "staleness_max" not in m:
        return ""
    text = (
        f"  stale max {m['staleness_max']} mean {m['staleness_mean']:.2f}  wait {m['sample_wait_seconds']:.2f}s"
        f"  overlap {m['overlap']:.2f}"
    )
    if m["stale_dropped"]:
        text += f"  {m['stale_dropped']} too stale, made again"
    if m["dynamic_dropped"] or m["dynamic_kept_uninformative"]:
        text += f"  equal rewards: {m['dynamic_dropped']} dropped, {m['dynamic_kept_uninformative']} kept"
    return text


def _moves_text(m: dict) -> str:
    """The colocated moves' rate against its ceiling, and the recovery snapshots, when there are any."""
    text = ""
    if m.get("sleep_wake_gbps"):
        ceiling = m.get("sleep_wake_ceiling_gbps")
        text += f"  sleep/wake {m['sleep_wake_bytes'] / 1e9:.2f} GB at {m['sleep_wake_gbps']:.1f} GB/s"
        text += f" (pinned copy {ceiling:.1f} GB/s)" if ceiling else " (no copy ceiling on CPU)"
    if m.get("trainer_reserved_before_bytes") is not None:
        before, after = m["trainer_reserved_before_bytes"], m["trainer_reserved_after_bytes"]
        text += f"  trainer reserved {before / 2**30:.1f} -> {after / 2**30:.1f} GiB"
    if m.get("train/peak_reserved_gb") is not None:
        text += f"  trainer peak {m['train/peak_reserved_gb']:.1f} GB"
    if m.get("engine_graph_captures"):
        text += f"  graphs recaptured {m['engine_graph_captures']} in {m['engine_graph_capture_seconds']:.2f}s"
    if m.get("snapshot_write_seconds") is not None:
        text += f"  snapshot written in {m['snapshot_write_seconds']:.2f}s"
    if m.get("snapshot_skipped"):
        text += "  snapshot skipped (last still writing)"
    return text


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.5))
    left.plot(steps, [r["reward_mean"] for r in rows], label="mean reward")
    left.plot(steps, [r["exact"] for r in rows], label="exact copies")
    left.set_xlabel("step")
    left.legend()
    right.plot(steps, [r["train/loss"] for r in rows], color="tab:red")
    right.set_xlabel("step")
    right.set_title("loss")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
