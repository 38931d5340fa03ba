"""The GRPO loop: generate -> reward -> advantages -> train -> sync -> next.

Ordering, stated once: a step's samples all come from the weight version of that step (the fleet
routes only to engines verified at the current version); the trainer's push completes and every
engine is verified before the next generate; colocated engines release their memory before the
trainer trains and get weights pushed again after resuming them.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from pathlib import Path

import ray
from rich.console import Console

from rollfleet.config import RunConfig
from rollfleet.data.prompts import PromptDataset
from rollfleet.data.synthetic import make_records
from rollfleet.fleet.fleet import Fleet
from rollfleet.fleet.health import EngineState
from rollfleet.rewards import load_reward
from rollfleet.sample import Sample
from rollfleet.train.grpo import group_advantages
from rollfleet.train.worker import TrainerGroup
from rollfleet.weights.checkpoint import atomic_directory, prune_versions

PHASES = ("generate", "reward", "train", "sync", "sleep_wake", "recovery")


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


def load_dataset(cfg: RunConfig) -> PromptDataset:
    if cfg.grpo.dataset == "synthetic":
        return PromptDataset.from_records(
            make_records(cfg.grpo.synthetic_prompts, num_digits=cfg.grpo.synthetic_digits, seed=cfg.grpo.seed)
        )
    return PromptDataset.from_jsonl(cfg.grpo.dataset)


class MetricsLog:
    def __init__(self, output_dir: Path, resume: bool):
        from torch.utils.tensorboard import SummaryWriter

        self.path = output_dir / "metrics.jsonl"
        if not resume:
            self.path.unlink(missing_ok=True)
        self.tensorboard = SummaryWriter(str(output_dir / "tensorboard"))

    def write(self, step: int, metrics: dict) -> None:
        with open(self.path, "a") as handle:
            handle.write(json.dumps({"step": step, **metrics}) + "\n")
        for key, value in metrics.items():
            if isinstance(value, (int, float)):
                self.tensorboard.add_scalar(key, value, step)

    def rows(self) -> list[dict]:
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]

    def close(self) -> None:
        self.tensorboard.close()


def latest_state(output_dir: Path) -> Path | None:
    states = sorted(output_dir.glob("checkpoints/state-step-*"), key=lambda p: int(p.name.rsplit("-", 1)[1]))
    return states[-1] if states else None


def train(cfg: RunConfig, *, resume: bool = False, console: Console | None = None) -> Path:
    if cfg.weight_sync.transport == "lora":
        raise ValueError(
            "weight_sync.transport='lora': the GRPO trainer trains full weights, it has no LoRA "
            "adapter to send; use tensor, nccl or disk (a LoRA run pushes with "
            "Fleet.sync_weights(LoraSource(peft_model), version))"
        )
    console = console or Console()
    output_dir = Path(cfg.grpo.output_dir).resolve()
    output_dir.mkdir(parents=True, exist_ok=True)
    dataset, reward_fn = load_dataset(cfg), load_reward(cfg.grpo.reward)
    fleet = trainers = None
    log = MetricsLog(output_dir, resume)
    try:
        fleet = Fleet.from_config(cfg)
        colocated = cfg.rollout.placement == "colocated"
        trainers = TrainerGroup(cfg, fleet.placement_group if colocated else None)
        start = 0
        state = latest_state(output_dir) if resume else None
        if state is not None:
            start = int(trainers.load_state(str(state))["step"])
            console.print(f"resumed from {state} at step {start}")
        if state is not None or colocated:  # engines must hold the trainer's weights before step `start`
            _sync(cfg, fleet, trainers, version=str(start))
        if colocated:
            trainers.offload()
        for step in range(start, cfg.grpo.steps):
            clock = StepClock()
            metrics = _step(cfg, fleet, trainers, dataset, reward_fn, step, clock, colocated)
            metrics["time"] = clock.breakdown()
            log.write(step + 1, {**_flatten(metrics), "engine_events": metrics["engine_events"]})
            console.print(_line(step + 1, cfg.grpo.steps, metrics), markup=False, highlight=False, soft_wrap=True)
            if cfg.grpo.checkpoint_every and (step + 1) % cfg.grpo.checkpoint_every == 0:
                _checkpoint(trainers, output_dir, step + 1, colocated)
        _checkpoint(trainers, output_dir, cfg.grpo.steps, colocated)
    except KeyboardInterrupt:
        console.print("[yellow]interrupted: stopping engines and trainers; the last checkpoint is intact")
    finally:
        log.close()
        if trainers is not None:
            trainers.shutdown()
        if fleet is not None:
            fleet.shutdown()
        ray.shutdown()
    if log.path.exists():
        plot(log.rows(), output_dir / "curves.png")
    return output_dir


def _step(
    cfg,
    fleet: Fleet,
    trainers: TrainerGroup,
    dataset: PromptDataset,
    reward_fn,
    step: int,
    clock: StepClock,
    colocated: bool,
) -> dict:
    # Engines that died are restarted here, at the step boundary, where a colocated trainer has
    # already released the GPU; they restore from the disk checkpoint of the current version, or
    # take the trainer's push at the end of this step (AWAITING_WEIGHTS until then, no traffic).
    if any(s.state == EngineState.INACTIVE for s in fleet.slots):
        with clock.phase("recovery"):
            fleet.restart_inactive()
    items = dataset.batch(step, cfg.grpo.prompts_per_step, seed=cfg.grpo.seed)
    with ThreadPoolExecutor(cfg.grpo.reward_threads) as pool:
        pending = {}  # rewards start as each prompt's samples arrive, while the rest still generate

        def score(group: list[Sample]) -> None:
            for s in group:
                pending[s.prompt_index, s.sample_index] = pool.submit(reward_fn, s.text, items[s.prompt_index].answer)

        with clock.phase("generate"):
            samples = fleet.generate([item.prompt for item in items], on_group=score)
        with clock.phase("reward"):  # only what generation did not already hide
            rewards = [pending[s.prompt_index, s.sample_index].result() for s in samples]
    for sample, reward in zip(samples, rewards):
        sample.reward = reward
    advantages = group_advantages(rewards, cfg.rollout.sampling.n, scale_by_std=cfg.train.scale_adv_by_std)
    # colocated: from the engines' release to the trainer's offload, the trainer holds the GPUs, so
    # no engine restart may start (a background restart waits for the end of this block)
    with fleet.restarts_paused() if colocated else nullcontext():
        if colocated:
            with clock.phase("sleep_wake"):
                fleet.sleep()
                trainers.onload()
        with clock.phase("train"):
            train_metrics = trainers.train_step([_train_item(s, float(a)) for s, a in zip(samples, advantages)])
        if colocated:
            with clock.phase("sleep_wake"):
                fleet.wake(["weights"])  # SGLang order: resume weights, push them, resume the KV cache
        with clock.phase("sync"):
            report = _sync(cfg, fleet, trainers, version=str(step + 1))
        every = cfg.grpo.recovery_checkpoint_every
        if every and cfg.weight_sync.transport != "disk" and (step + 1) % every == 0:
            with clock.phase("recovery"):  # what a restarted engine restores from
                _save_recovery_checkpoint(fleet, trainers, Path(cfg.grpo.output_dir).resolve(), str(step + 1))
        if colocated:
            with clock.phase("sleep_wake"):
                trainers.offload()  # after the push: the trainer's parameters are what was sent
                fleet.wake(["kv_cache"])
    versions = {s.weight_version for s in samples}
    assert versions == {str(step)} or step == 0 and versions <= {"default", "0"}, versions
    n = cfg.rollout.sampling.n
    assert [(s.prompt_index, s.sample_index) for s in samples] == [(p, k) for p in range(len(items)) for k in range(n)]
    events = fleet.take_events()
    return {
        "reward_mean": sum(rewards) / len(rewards),
        "reward_max": max(rewards),
        "exact": sum(r == 1.0 for r in rewards) / len(rewards),
        "response_tokens": sum(len(s.output_ids) for s in samples) / len(samples),
        "train": train_metrics,
        "sync_gb_per_s": report.gb_per_s,
        "sync_seconds": report.seconds,
        "engine_failures": sum(e["to"] == "INACTIVE" for e in events),
        "engine_recoveries": sum(e["to"] == "ACTIVE" and e["why"].startswith("recovered") for e in events),
        "engine_events": events,
    }


def _sync(cfg, fleet: Fleet, trainers: TrainerGroup, version: str, attempts: int = 3):
    """Push to every running engine and verify. An engine that dies during the push is restarted
    and the push is made again (the engines that already took it verify again: idempotent)."""
    options = {"config_dir": cfg.rollout.model_path} if cfg.weight_sync.transport == "disk" else {}
    for attempt in range(attempts):
        marks = {s.engine_id: len(s.lifecycle.history) for s in fleet.slots}
        try:
            report = trainers.push_weights(cfg.weight_sync, fleet.weight_targets(), version, **options)
            fleet.verify(report)
            return report
        except Exception:
            if attempt == attempts - 1 or not _engine_died(fleet, marks):
                raise
            fleet.restart_inactive(restore=False)  # they take this very push


def _engine_died(fleet: Fleet, marks: dict[int, int], grace_s: float = 2.0) -> bool:
    """Whether an engine went INACTIVE (or on to RECOVERING: the background restarter may already
    have picked it up) since `marks` (each lifecycle's history length when the push began), now
    or within the death watch's reaction time."""
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        for slot in fleet.slots:
            if any(
                new in (EngineState.INACTIVE, EngineState.RECOVERING)
                for _, _, new, _ in slot.lifecycle.history[marks.get(slot.engine_id, 0) :]
            ):
                return True
        time.sleep(0.05)
    return False


def _save_recovery_checkpoint(fleet: Fleet, trainers: TrainerGroup, output_dir: Path, version: str) -> None:
    root = output_dir / "recovery"
    final = root / f"version-{version}"
    with atomic_directory(final) as partial:
        trainers.save_hf(str(partial))
    fleet.register_checkpoint(version, str(final))
    prune_versions(root, keep=2)


def _train_item(sample: Sample, advantage: float) -> dict:
    return {
        "prompt_ids": sample.prompt_ids,
        "output_ids": sample.output_ids,
        "logprobs": sample.logprobs,
        "advantage": advantage,
    }


def _checkpoint(trainers: TrainerGroup, output_dir: Path, step: int, colocated: bool) -> None:
    """An HF checkpoint and a resumable state, each written under a temporary name and renamed,
    so an interrupted save never replaces the last good one. A colocated trainer sits offloaded
    between steps: it comes back for the save and leaves again."""
    root = output_dir / "checkpoints"
    if colocated:
        trainers.onload()
    for kind, save in (("hf", trainers.save_hf), ("state", lambda p: trainers.save_state(p, {"step": step}))):
        with atomic_directory(root / f"{kind}-step-{step}") as partial:
            save(str(partial))
    if colocated:
        trainers.offload()


def _flatten(metrics: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in metrics.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}/"))
        elif not isinstance(value, list):
            out[f"{prefix}{key}"] = value
    return out


def _line(step: int, steps: int, m: dict) -> str:
    t = m["time"]
    return (
        f"step {step:>4}/{steps}  reward {m['reward_mean']:.3f}  exact {m['exact']:.2f}  "
        f"loss {m['train']['loss']:+.4f}  mismatch {m['train']['logprob_mismatch_mean']:.1e}  "
        f"[gen {t['generate']:.2f}s train {t['train']:.2f}s sync {t['sync']:.2f}s "
        f"sleep/wake {t['sleep_wake']:.2f}s other {t['other']:.2f}s]"
        + (
            f"  engines failed {m['engine_failures']}, recovered {m['engine_recoveries']}"
            if m["engine_failures"] or m["engine_recoveries"]
            else ""
        )
    )


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
