"""The GRPO loop: generate -> reward -> advantages -> train -> sync -> next.

Ordering, stated once: a step's samples all come from the weight version of that step (the fleet
routes only to engines verified at its version; `check_samples` raises when one is not, or when a
prompt's group is incomplete or doubled); the trainer's push completes and every engine is verified
before the next generate (`Fleet.sync_from`); colocated engines release their memory while the
trainer trains and get weights pushed again after resuming them (`Fleet.trainer_turn`).

With grpo.max_staleness = k >= 1 (or dynamic sampling) the samples come from a SampleStream
(rollfleet.train.sample_stream, which states its own ordering): made ahead of the trainer while it
trains, each step's samples hold no token older than step - k (`check_staleness` raises), and the
push waits for the generate call under way, then runs alone.

With grpo.environment each sample is an episode (rollfleet.agents: model turns and observations, one
token list with a loss mask), made by the same calls and checked by the same invariants.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import ray
from rich.console import Console

from rollfleet.agents.figures import episode_figures
from rollfleet.agents.rollout import AgentRollout
from rollfleet.config import ConfigError, RunConfig
from rollfleet.data.arithmetic import make_arithmetic_records
from rollfleet.data.prompts import PromptDataset, PromptItem
from rollfleet.data.synthetic import make_records
from rollfleet.envs import load_environment
from rollfleet.fleet.fleet import Fleet
from rollfleet.rewards import load_reward
from rollfleet.sample import Sample
from rollfleet.train.grpo import group_advantages
from rollfleet.train.invariants import check_complete, check_samples, check_staleness
from rollfleet.train.lora import check_targets
from rollfleet.train.memory_setup import plan_run
from rollfleet.train.metrics import MetricsLog, StepClock, console_line, plot, sleep_wake_figures, step_metrics
from rollfleet.train.prompt_cursor import PromptCursor
from rollfleet.train.recovery import RecoverySnapshots
from rollfleet.train.routing_replay import check_replayable
from rollfleet.train.run_inputs import check_run_inputs
from rollfleet.train.sample_stream import SampleStream, generate_and_reward, prompt_seeds
from rollfleet.train.worker import TrainerGroup
from rollfleet.weights.checkpoint import atomic_directory

log = logging.getLogger("rollfleet.loop")
Observer = Callable[[int, list[PromptItem], list[Sample]], None]


@dataclass
class Run:
    cfg: RunConfig
    fleet: Fleet
    trainers: TrainerGroup
    dataset: PromptDataset
    reward_fn: Callable[[str, str], float]
    output_dir: Path
    snapshots: RecoverySnapshots
    observe: Observer | None = None  # (step, prompts, samples) after each generate (tests record them)
    copy_ceiling: dict | None = None  # pinned host<->device GB/s of the trainer's device (None on CPU)
    graph_totals: tuple[int, float] = (0, 0.0)  # the engines' decode graph captures at the last turn
    stream: SampleStream | None = None  # where samples come from when they are made ahead or filtered
    agent: AgentRollout | None = None  # grpo.environment: samples are multi-turn episodes


def uses_stream(cfg: RunConfig) -> bool:
    """Whether a run's samples come from a SampleStream: asynchronous steps, or dynamic sampling."""
    return cfg.grpo.max_staleness > 0 or cfg.grpo.dynamic_sampling


def load_dataset(cfg: RunConfig) -> PromptDataset:
    if cfg.grpo.dataset == "arithmetic":  # the agent demo's (rollfleet.envs.calculator)
        return PromptDataset.from_records(make_arithmetic_records(cfg.grpo.synthetic_prompts, seed=cfg.grpo.seed))
    if cfg.grpo.dataset == "synthetic":
        return PromptDataset.from_records(
            make_records(cfg.grpo.synthetic_prompts, num_digits=cfg.grpo.synthetic_digits, seed=cfg.grpo.seed)
        )
    return PromptDataset.from_jsonl(cfg.grpo.dataset)


def latest_state(output_dir: Path) -> Path | None:
    states = sorted(output_dir.glob("checkpoints/state-step-*"), key=lambda p: int(p.name.rsplit("-", 1)[1]))
    return states[-1] if states else None


def train(
    cfg: RunConfig, *, resume: bool = False, console: Console | None = None, observe: Observer | None = None
) -> Path:
    check_run_inputs(cfg)  # the model, data, reward or environment it names: before anything starts
    if cfg.train.lora is None and cfg.weight_sync.transport == "lora":
        raise ConfigError(
            "weight_sync.transport='lora': the lora transport sends only an adapter, and this run trains the full "
            "weights (fix: set train.lora, e.g. train.lora.rank=8, or weight_sync.transport to tensor, nccl or disk)"
        )
    if cfg.train.lora is not None:  # the config paired it with the lora transport; here: the model's modules
        check_targets(cfg.train.lora, cfg.rollout.model_path)
    if cfg.train.routing_replay:
        check_replayable(cfg.rollout.model_path)
    console = console or Console()
    output_dir = Path(cfg.grpo.output_dir).resolve()
    output_dir.mkdir(parents=True, exist_ok=True)
    log, run = MetricsLog(output_dir, resume), None
    owns_ray = not ray.is_initialized()  # a Ray the caller started stays up for the caller
    try:
        dataset = load_dataset(cfg)
        cfg, _ = plan_run(cfg, output_dir, [item.prompt for item in dataset.items])  # `auto` resolved here
        run = _start(cfg, output_dir, dataset, observe)
        _freeze_setup()
        start, version, saved = _resume_point(run, resume, console)
        cursor = PromptCursor.from_state(saved.get("prompt_cursor"), start, cfg.grpo.prompts_per_step)
        if uses_stream(cfg) or not cursor.at_step(start, cfg.grpo.prompts_per_step):
            # a synchronous run resumed from an asynchronous state whose record is not the plain
            # loop's (groups dropped, or used out of order) goes on from that record, at k = 0
            run.stream = SampleStream(cfg, run.fleet, run.dataset, run.reward_fn, cursor, start, run.agent)
        saved_at = None
        for step in range(start, cfg.grpo.steps):
            metrics = _streamed_step(run, step) if run.stream else _step(run, step, version)
            version = str(step + 1)
            log.write(step + 1, metrics)
            console.print(
                console_line(step + 1, cfg.grpo.steps, metrics), markup=False, highlight=False, soft_wrap=True
            )
            if _checkpoint_due(cfg.grpo, step + 1):
                _checkpoint(run, step + 1)
                saved_at = step + 1
        if cfg.grpo.final_checkpoint and saved_at != cfg.grpo.steps:  # the last step's state, once
            _checkpoint(run, cfg.grpo.steps)
    except KeyboardInterrupt:
        console.print("[yellow]interrupted: stopping engines and trainers; the last checkpoint is intact")
    finally:
        gc.unfreeze()  # _freeze_setup's objects are the collector's again (the run's are garbage now)
        log.close()
        if run is not None:
            if run.stream is not None:
                run.stream.close()  # no chunk starts any more; the one under way ends with its generate call
            run.snapshots.close()  # a snapshot being written finishes (or is cancelled) before the trainers go
            run.trainers.shutdown()
            run.fleet.shutdown()
        if owns_ray:
            ray.shutdown()
    if log.path.exists():
        plot(log.rows(), output_dir / "curves.png")
    return output_dir


def _freeze_setup() -> None:
    """The driver's imports (torch, transformers, Ray: ~340k objects) and the run's fleet and trainer
    handles live as long as the run: out of the collector's scans (gc.freeze, as the engines and the
    trainer actors do). Each step parses every answer into new lists and floats, and the collector's
    passes over the setup's objects tripled that parse (5.2 MB of answers, 512 x 256 logprobs: 182 ms
    against 50 ms frozen, on the CPU). `train` undoes it when the run ends."""
    gc.collect()
    gc.freeze()


def _start(cfg: RunConfig, output_dir: Path, dataset: PromptDataset, observe: Observer | None) -> Run:
    grpo = cfg.grpo
    environment = load_environment(grpo.environment) if grpo.environment else None  # before any process starts
    fleet, trainers = start_fleet_and_trainers(cfg)
    snapshots = RecoverySnapshots(cfg.recovery_snapshot_every, fleet, trainers, output_dir / "recovery")
    run = Run(cfg, fleet, trainers, dataset, load_reward(grpo.reward), output_dir, snapshots, observe)
    if environment is not None:
        run.agent = AgentRollout(fleet, environment, grpo.environment_args, grpo.agent)
    return run


def start_fleet_and_trainers(cfg: RunConfig) -> tuple[Fleet, TrainerGroup]:
    """The fleet and the trainers, their starts overlapped: the trainer ranks build their models
    while the engines start (colocated ranks need the fleet's placement group, so they are created
    once it exists; not beside SGLang engines, which size their memory pool from what is free)."""
    colocated = cfg.rollout.placement == "colocated"
    trainers: TrainerGroup | None = None

    def begin(group) -> None:
        nonlocal trainers
        trainers = TrainerGroup(cfg, group if colocated else None, wait=False)

    overlap = not (colocated and cfg.rollout.backend == "sglang")
    try:
        fleet = Fleet.from_config(cfg, on_placement=begin if overlap else None)
    except BaseException:
        if trainers is not None:
            trainers.shutdown()
        raise
    try:
        trainers = trainers.ready() if trainers else TrainerGroup(cfg, fleet.placement_group if colocated else None)
    except BaseException:
        fleet.shutdown()
        raise
    return fleet, trainers


def _resume_point(run: Run, resume: bool, console: Console) -> tuple[int, str, dict]:
    """The first step, the weight version its samples come from, and what the resumed state saved
    beside the step. A resumed run, every colocated run (whose engines released the model to the
    trainer) and every run whose samples come from a stream (it needs step-numbered versions to
    measure staleness) push the trainer's weights first."""
    state = latest_state(run.output_dir) if resume else None
    start, saved = 0, {}
    if state is not None:
        saved = run.trainers.load_state(str(state))
        start = int(saved["step"])
        console.print(f"resumed from {state} at step {start}")
    if state is None and run.cfg.rollout.placement != "colocated" and not uses_stream(run.cfg):
        return start, run.fleet.version, saved  # the engines serve the model they loaded
    with run.fleet.trainer_turn(run.trainers):
        run.fleet.sync_from(run.trainers, str(start))
    return start, str(start), saved


def _step(run: Run, step: int, version: str) -> dict:
    cfg, fleet, clock = run.cfg, run.fleet, StepClock()
    with clock.phase("recovery"):
        recovery_errors = _restart_inactive(fleet)
    per_step = cfg.grpo.prompts_per_step
    items = run.dataset.batch(step, per_step, seed=cfg.grpo.seed)  # positions step*P .. of the prompt stream
    seeds = prompt_seeds(cfg.sampling_seed, range(step * per_step, (step + 1) * per_step))
    retries = fleet.router.retries
    samples = generate_and_reward(
        fleet, run.reward_fn, items, cfg.grpo.reward_threads, clock.phase, cfg.train.routing_replay, run.agent, seeds
    )
    check_samples(samples, len(items), cfg.rollout.sampling.n, version)
    if run.observe is not None:
        run.observe(step, items, samples)
    return {**_train_and_push(run, step, samples, clock, retries), "recovery_errors": recovery_errors}


def _streamed_step(run: Run, step: int) -> dict:
    """A step whose samples the run's SampleStream made, ahead of the trainer by up to k versions
    (k = 0 with dynamic sampling: made now); the push waits for the generate call under way."""
    cfg, fleet, clock = run.cfg, run.fleet, StepClock()
    with clock.phase("recovery"):
        recovery_errors = _restart_inactive(fleet)
    retries = fleet.router.retries
    with clock.phase("generate"):  # what the trainer waited: the generation that training did not hide
        taken = run.stream.take(step)
    items, samples = taken.items, taken.samples
    ages = check_staleness(samples, step, cfg.grpo.max_staleness)
    check_complete(samples, len(items), cfg.rollout.sampling.n)
    if run.observe is not None:
        run.observe(step, items, samples)
    metrics = _train_and_push(run, step, samples, clock, retries)
    return {**metrics, **taken.figures(ages), "recovery_errors": recovery_errors}


def _train_and_push(run: Run, step: int, samples: list[Sample], clock: StepClock, retries: int) -> dict:
    """Advantages, the train step, the push of version step + 1 (with a stream: once its generate call
    under way ended; push_wait_seconds says how long that took), the recovery snapshot; the metrics."""
    cfg, fleet, trainers = run.cfg, run.fleet, run.trainers
    advantages = group_advantages(
        [s.reward for s in samples], cfg.rollout.sampling.n, scale_by_std=cfg.train.scale_adv_by_std
    )
    batch = [_train_item(s, float(a)) for s, a in zip(samples, advantages)]
    moves: dict = {}
    with fleet.trainer_turn(trainers, timed=clock.phase, moves=moves):
        with clock.phase("train"):
            train_metrics = trainers.train_step(batch)
        alone = run.stream.gate.pushing() if run.stream is not None else nullcontext(None)
        with clock.phase("sync"), alone as push_wait:
            report = fleet.sync_from(trainers, str(step + 1))
        if run.stream is not None:
            run.stream.pushed(step + 1)
        with clock.phase("recovery"):  # a host copy at most: the snapshot is written in the background
            snapshot = run.snapshots.after_sync(step + 1, str(step + 1))
    _graph_captures_since_last_turn(run, moves)
    recovery = {**snapshot, "snapshots_written": run.snapshots.take_written()}
    events, retries = fleet.take_events(), fleet.router.retries - retries
    metrics = step_metrics(samples, train_metrics, report, events, clock, retries, sleep_wake=moves, recovery=recovery)
    waited = {} if push_wait is None else {"push_wait_seconds": push_wait}
    episodes = {"episodes": episode_figures(samples)} if run.agent is not None else {}
    return {**metrics, **_against_copy_ceiling(run, moves), **waited, **episodes}


def _against_copy_ceiling(run: Run, moves: dict) -> dict:
    """The sleep/wake figures with the pinned copy ceiling beside them, measured once per run on the
    trainer's device after the first step that moved bytes (outside the step's clock)."""
    moved = max(moves.get("trainer_onload_bytes", 0), moves.get("trainer_offload_bytes", 0))
    if moved and run.copy_ceiling is None:
        run.copy_ceiling = run.trainers.copy_ceiling(moved)
    return sleep_wake_figures(moves, run.copy_ceiling)


def _graph_captures_since_last_turn(run: Run, moves: dict) -> None:
    """Into `moves`: the engines' decode graph captures (and seconds) since the last colocated turn,
    i.e. in this step's generate, after the last release dropped them (a restart resets a total)."""
    if "engine_graph_captures_total" not in moves:  # no turn: nothing released
        return
    totals = (moves["engine_graph_captures_total"], moves["engine_graph_capture_seconds_total"])
    previous, run.graph_totals = run.graph_totals, totals
    moves["engine_graph_captures"] = max(totals[0] - previous[0], 0)
    moves["engine_graph_capture_seconds"] = max(totals[1] - previous[1], 0.0)


def _restart_inactive(fleet: Fleet) -> int:
    """Dead engines restart at the step boundary: restored, or they take this step's push; unless the
    background restarter does it (`rollout.auto_restart`) while an engine serves: the step then goes
    on with the engines that serve instead of waiting for a start. A failure here never ends the run
    (the engines stay out of rotation; the background restarter and the next step try again): it is
    logged and counted in the step's metrics."""
    if fleet.rollout.auto_restart and fleet.router.serving(fleet.version, exclude=set()):
        return 0
    try:
        fleet.restart_inactive()
    except Exception:  # noqa: BLE001 - logged and counted, not swallowed
        log.exception("restarting engines failed; the step goes on with the engines that are ACTIVE")
        return 1
    return 0


def _train_item(sample: Sample, advantage: float) -> dict:
    return {
        "prompt_ids": sample.prompt_ids,
        "output_ids": sample.output_ids,
        "logprobs": sample.logprobs,
        "advantage": advantage,
        **({"loss_mask": sample.loss_mask} if sample.loss_mask is not None else {}),
        **({"routed_experts": sample.routed_experts} if sample.routed_experts is not None else {}),
    }


def _checkpoint_due(grpo, step: int) -> bool:
    """Whether `checkpoint_every` saves after `step` (the last step only with `final_checkpoint`)."""
    every = grpo.checkpoint_every
    return bool(every) and step % every == 0 and (step < grpo.steps or grpo.final_checkpoint)


def _checkpoint(run: Run, step: int) -> None:
    """An HF checkpoint (a LoRA run: its adapter, whose config names the base) and a resumable state,
    each written under a temporary name and renamed, so an interrupted save never replaces the last
    good one. A colocated trainer sits offloaded between steps: it comes back for the save and leaves
    again."""
    root, trainers = run.output_dir / "checkpoints", run.trainers
    colocated = run.cfg.rollout.placement == "colocated"
    if colocated:
        trainers.onload()
    extra = {"step": step} if run.stream is None else {"step": step, "prompt_cursor": run.stream.cursor.state()}
    model = "adapter" if run.cfg.train.lora is not None else "hf"  # a LoRA run saves its adapter (peft layout)
    for kind, save in ((model, trainers.save_hf), ("state", lambda p: trainers.save_state(p, extra))):
        with atomic_directory(root / f"{kind}-step-{step}") as partial:
            save(str(partial))
    if colocated:
        trainers.offload()
