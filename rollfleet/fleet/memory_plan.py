"""The memory plan of a colocated GPU: one place decides, before any process starts, what each GPU
holds in each turn, what the engines get, and what moves at a turn.

A GPU holds one trainer rank and one engine rank, in two turns:
- the trainer's turn: the engine has released its KV pool and CUDA graphs (and, with
  rollout.release_weights, its weights); the trainer holds its parameters, gradients and optimizer
  state (sharded over trainer.world_size by FSDP2) and the peak of one micro batch;
- the engines' turn (generate): the engine holds `mem_fraction_static` of the GPU, as both backends
  mean it: weights + KV pool (the embedded engine's allocator is capped there, so its activation
  reserve is inside it too; SGLang's activations and graphs are outside it); beside it the trainer
  keeps its parameters and optimizer state unless train.offload moves them to host.
Beside both: a CUDA context per process and a margin of the GPU.

Cheapest of all is a turn that releases nothing (`rollout.release_kv_cache` false): the engines
keep their weights, KV pool and CUDA graphs through the trainer's turn, so the GPU holds both turns at
once; a turn is the push alone (no release, resume, re-zeroing or graph capture; the trainer keeps its
allocator's cache). `auto` picks it when the trainer's turn, with TRAINER_HEADROOM over its figures,
fits beside an engine whose KV pool still holds the step's samples at once; the trainer's allocator is
then capped at what the engine leaves (train.gpu_memory_cap: past it, it frees its cache and retries).

Otherwise the engines get what the trainer leaves (at most 0.85, the engines' own default), or the user's
fraction is checked. `auto` moves nothing when both fit; else, cheapest first: the engines' weights
are released for the trainer's turn (the push rewrites them anyway; the re-allocation costs ~15 ms),
then the trainer's state goes to host while the engines generate (a copy each way: 0.75 s for
17.5 GB on an H200). The two fix different turns: release_weights makes room in the trainer's,
offload in the engines' (it is chosen when the KV pool could not hold the step's samples at once).
A run that cannot fit is refused with the figures and the settings to change.

Embedded engines run at most the step's samples at once (`_running`): their logits reserve, 3 fp32
copies of batch x vocab, is 0.23 GB for a 16 x 8 x 32 step instead of 7.5 GB for 4096 requests, which
kept that step on an 80 GB GPU from keeping its KV cache (2026-12-06).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

from rollfleet.config import ConfigError, RunConfig
from rollfleet.engine.kv.capacity import DEFAULT_GPU_FRACTION, GPU_MAX_RUNNING_REQUESTS, activation_reserve_bytes
from rollfleet.fleet.memory_figures import ModelShape

GB = 1e9
CONTEXT_BYTES = 2**30  # one process's CUDA context, cuBLAS workspace and NCCL buffers
MARGIN = 0.04  # of the GPU: allocator fragmentation and what the figures leave out
MIN_KV_TOKENS = 1024  # the embedded engine's pool refuses fewer (rollfleet.engine.kv.pool)
DEFAULT_LOGPROB_CHUNK = 1024  # positions per log-prob chunk until train.logprob_chunk exists
# the trainer's share when the engines keep their memory through its turn, over its figures: on the H200
# its allocator reserved up to 1.11 x them (71.7 GB at the end of a turn planned at 64.6, 2026-12-05)
TRAINER_HEADROOM = 1.25


@dataclass(frozen=True)
class MemoryPlan:
    """The plan of one GPU: each part in bytes, the two turns' totals and what was decided."""

    gpu_bytes: int
    parts: dict[str, int]
    release_weights: bool
    offload: bool
    mem_fraction_static: float
    fraction_from: str  # "plan" or "rollout.mem_fraction_static"
    kv_pool_tokens: int
    step_tokens: int  # prompts x n x width: the step's samples at once
    width: int  # prompt bound + new tokens (an episode's budget)
    micro_batch_rows: int
    logprob_chunk: int
    release_kv_cache: bool = True  # False: the engines keep all their memory through the trainer's turn
    trainer_cap: float | None = None  # the trainer's allocator cap, a fraction of the GPU (release_kv_cache False)
    max_running_requests: int | None = None  # embedded engines' --max-running-requests (None: the user's, or SGLang's)

    @property
    def trainer_figures(self) -> int:
        """The trainer's own bytes in its turn: state, gradients and the peak of a step."""
        p = self.parts
        return p["trainer_state"] + p["trainer_gradients"] + p["trainer_peak"]

    @property
    def trainer_turn_bytes(self) -> int:
        engine = 0 if self.release_weights else self.parts["engine_weights"]
        return self.trainer_figures + engine + _overheads(self.parts)

    @property
    def kv_need(self) -> int:
        """Tokens the KV pool holds for the step's samples at once (and one whole episode)."""
        return max(self.step_tokens, MIN_KV_TOKENS, self.width)

    @property
    def room_beside_engine(self) -> float:
        """What the engine's share leaves the trainer while both turns' memory is on the GPU."""
        p = self.parts
        return self.gpu_bytes - _overheads(p) - p["engine_outside"] - self.mem_fraction_static * self.gpu_bytes

    @property
    def stays_fit(self) -> bool:
        """The engines may keep their memory through the trainer's turn: the trainer's figures x
        TRAINER_HEADROOM fit beside the engine, whose KV pool holds the step's samples at once."""
        return (
            self.room_beside_engine >= TRAINER_HEADROOM * self.trainer_figures and self.kv_pool_tokens >= self.kv_need
        )

    @property
    def engine_turn_bytes(self) -> int:
        p = self.parts
        trainer = 0 if self.offload else p["trainer_state"]
        if not self.release_kv_cache:  # one turn: the trainer's whole cap beside the engine's share
            trainer = round(self.trainer_cap * self.gpu_bytes)
        return round(self.mem_fraction_static * self.gpu_bytes) + p["engine_outside"] + trainer + _overheads(p)

    def as_dict(self) -> dict:
        """GB figures for the log, memory-plan.json and the benches' records."""
        out = asdict(self)
        out["gpu_gb"] = round(out.pop("gpu_bytes") / GB, 2)
        out["parts_gb"] = {k: round(v / GB, 2) for k, v in out.pop("parts").items()}
        out["trainer_turn_gb"] = round(self.trainer_turn_bytes / GB, 2)
        out["engine_turn_gb"] = round(self.engine_turn_bytes / GB, 2)
        return out

    def apply(self, cfg: RunConfig) -> RunConfig:
        """`cfg` with the plan's booleans and fraction (what the fleet and the trainers read)."""
        rollout = cfg.rollout.model_copy(
            update={
                "release_weights": self.release_weights,
                "release_kv_cache": self.release_kv_cache,
                "mem_fraction_static": self.mem_fraction_static,
            }
        )
        if self.max_running_requests is not None:
            extras = [*cfg.rollout.server_extras, "--max-running-requests", str(self.max_running_requests)]
            rollout = rollout.model_copy(update={"server_extras": extras})
        train = cfg.train.model_copy(update={"offload": self.offload, "gpu_memory_cap": self.trainer_cap})
        return cfg.model_copy(update={"rollout": rollout, "train": train})


def unplanned(cfg: RunConfig) -> RunConfig:
    """`auto` where no plan runs (CPU, disaggregated, a fleet built as a library): what runs did before
    the plan, release and offload (a LoRA run keeps its base weights: nothing pushes them)."""
    rollout, train = cfg.rollout, cfg.train
    if rollout.release_weights != "auto" and train.offload != "auto" and rollout.release_kv_cache != "auto":
        return cfg
    release = train.lora is None if rollout.release_weights == "auto" else rollout.release_weights
    offload = True if train.offload == "auto" else train.offload
    kv = True if rollout.release_kv_cache == "auto" else rollout.release_kv_cache
    return cfg.model_copy(
        update={
            "rollout": rollout.model_copy(update={"release_weights": release, "release_kv_cache": kv}),
            "train": train.model_copy(update={"offload": offload}),
        }
    )


def plan_memory(cfg: RunConfig, shape: ModelShape, gpu_bytes: int, prompt_tokens: int) -> MemoryPlan:
    """The plan of a colocated GPU run (see the module docstring); ConfigError when it cannot fit."""
    width = _width(cfg, prompt_tokens)
    samples = cfg.grpo.prompts_per_step * cfg.rollout.sampling.n
    rows = min(cfg.train.micro_batch_size, math.ceil(samples / _world(cfg)))
    chunk = getattr(cfg.train, "logprob_chunk", None) or DEFAULT_LOGPROB_CHUNK
    running, told = _running(cfg, samples)
    parts = _parts(cfg, shape, gpu_bytes, rows, width, chunk, running)
    kv_token = shape.kv_bytes_per_token(_engine_dtype_bytes(cfg, shape), cfg.rollout.tp_size)
    step_tokens = samples * width

    def plan(release: bool, offload: bool, fraction: float | None = None) -> MemoryPlan:
        chosen = fraction if fraction is not None else _largest_fraction(parts, gpu_bytes, offload)
        pool = _pool_tokens(parts, chosen, gpu_bytes, kv_token)
        source = "plan" if fraction is None else "rollout.mem_fraction_static"
        chunked = min(chunk, rows * width)
        return MemoryPlan(
            gpu_bytes, parts, release, offload, chosen, source, pool, step_tokens, width, rows, chunked,
            max_running_requests=told,
        )  # fmt: skip

    user = cfg.rollout.mem_fraction_static
    moves_set = cfg.rollout.release_weights is True or cfg.train.offload is True  # the user's moves stand
    if cfg.rollout.release_kv_cache is not True and not moves_set:  # the engines keep everything, where it fits
        forced = cfg.rollout.release_kv_cache is False  # not auto: a plan that does not fit is refused
        stay = _staying_plan(plan(False, False, user), kv_token, force=forced)
        if stay is not None:
            refuse_unless_fits(stay, cfg)
            return stay
    release = cfg.rollout.release_weights
    if release == "auto":  # keep the weights when the trainer's turn fits beside them (a LoRA run must)
        release = cfg.train.lora is None and plan(False, True).trainer_turn_bytes > gpu_bytes
    offload = cfg.train.offload
    if offload == "auto":  # keep the trainer's state when the engines still get room for the whole step
        kept, moved = plan(release, False, user), plan(release, True, user)
        too_full = kept.engine_turn_bytes > gpu_bytes or kept.kv_pool_tokens < max(MIN_KV_TOKENS, width)
        offload = too_full or (kept.kv_pool_tokens < step_tokens and moved.kv_pool_tokens > kept.kv_pool_tokens)
    chosen = plan(release, offload, user)
    refuse_unless_fits(chosen, cfg)
    return chosen


def _staying_plan(base: MemoryPlan, kv_token: int, force: bool = False) -> MemoryPlan | None:
    """`base` (weights kept, no offload) as a plan whose engines keep their memory through the trainer's
    turn: the engine's fraction leaves the trainer its figures x TRAINER_HEADROOM, and the trainer is
    capped at the rest. None when that does not fit (`force`: the plan anyway, for refuse_unless_fits
    to name the figures)."""
    p, gpu = base.parts, base.gpu_bytes
    fraction = base.mem_fraction_static
    if base.fraction_from == "plan":
        room = gpu - _overheads(p) - p["engine_outside"] - TRAINER_HEADROOM * base.trainer_figures
        fraction = max(min(math.floor(100 * room / gpu) / 100, DEFAULT_GPU_FRACTION), 0.01)
    pool = _pool_tokens(p, fraction, gpu, kv_token)
    stay = replace(base, mem_fraction_static=fraction, kv_pool_tokens=pool, release_kv_cache=False)
    if not (stay.stays_fit or force):
        return None
    return replace(stay, trainer_cap=max(math.floor(10_000 * stay.room_beside_engine / gpu) / 10_000, 0.0))


def _pool_tokens(parts: dict[str, int], fraction: float, gpu_bytes: int, kv_token: int) -> int:
    """The KV pool an engine's share of `fraction` holds after its weights and activations."""
    return max(int((fraction * gpu_bytes - parts["engine_weights"] - parts["engine_inside"]) // kv_token), 0)


def refuse_unless_fits(plan: MemoryPlan, cfg: RunConfig) -> None:
    """ConfigError naming the settings, the figures and the fixes when a turn does not fit."""
    gpu, parts, problems = plan.gpu_bytes, plan.parts, []
    head = f"rollout.placement=colocated on a GPU of {gpu / GB:.1f} GB"
    if plan.trainer_turn_bytes > gpu:
        engine = "" if plan.release_weights else f" + engine weights kept {parts['engine_weights'] / GB:.1f}"
        state = parts["trainer_state"] + parts["trainer_gradients"] + _overheads(parts)
        fixes = [] if state > gpu else ["train.micro_batch_size lower (its peak)"]
        fixes.append("trainer.world_size higher (FSDP shards the state)")
        fixes += [] if plan.release_weights or cfg.train.lora else ["rollout.release_weights=true"]
        fixes += [] if cfg.train.lora else ["train.lora (only an adapter trains)"]
        problems.append(
            f"{head}: the trainer's turn needs {plan.trainer_turn_bytes / GB:.1f} GB = parameters and optimizer "
            f"state {parts['trainer_state'] / GB:.1f} + gradients {parts['trainer_gradients'] / GB:.1f} + the peak "
            f"of a micro batch of {plan.micro_batch_rows} x {plan.width} tokens or of the optimizer step "
            f"{parts['trainer_peak'] / GB:.1f}{engine} "
            f"+ contexts and margin {_overheads(parts) / GB:.1f} (fix: {'; '.join(fixes)}; or "
            "rollout.placement=disaggregated); nothing was started"
        )
    if plan.engine_turn_bytes > gpu or plan.kv_pool_tokens < max(MIN_KV_TOKENS, plan.width):
        activations = (parts["engine_inside"] + parts["engine_outside"]) / GB
        kept = "" if plan.offload else f" + the trainer's state kept {parts['trainer_state'] / GB:.1f}"
        fixes = [] if plan.offload else ["train.offload=true"]
        if plan.fraction_from != "plan":
            way = "lower" if plan.engine_turn_bytes > gpu else "higher"
            fixes.append(f"rollout.mem_fraction_static {way} than {plan.mem_fraction_static} (or unset: planned)")
        problems.append(
            f"{head}: the engines' turn gives the engine {plan.mem_fraction_static} of it (weights "
            f"{parts['engine_weights'] / GB:.1f} + activations {activations:.1f} + a KV pool"
            f" of {plan.kv_pool_tokens} tokens, needs >= {max(MIN_KV_TOKENS, plan.width)}){kept} + "
            f"contexts and margin {_overheads(parts) / GB:.1f}: {plan.engine_turn_bytes / GB:.1f} GB (fix: "
            f"{'; '.join([*fixes, 'train.lora', 'rollout.tp_size higher', 'rollout.placement=disaggregated'])}); "
            "nothing was started"
        )
    if not plan.release_kv_cache:
        problems += _staying_problems(plan, head)
    if problems:
        raise ConfigError(problems)


def _staying_problems(plan: MemoryPlan, head: str) -> list[str]:
    """What keeps engines that hold their memory through the trainer's turn from fitting."""
    if plan.stays_fit:
        return []
    fixes = ["rollout.release_kv_cache=true (or auto: released where it does not fit)", "train.micro_batch_size lower"]
    if plan.fraction_from != "plan":
        fixes.append("rollout.mem_fraction_static unset (planned)")
    trainer, rest = plan.trainer_figures, max(plan.room_beside_engine, 0)
    return [
        f"{head}: rollout.release_kv_cache=false keeps the engine's {plan.mem_fraction_static} of it (a KV pool "
        f"of {plan.kv_pool_tokens} tokens; the step's samples need {plan.kv_need}) beside the trainer's whole turn, "
        f"{trainer / GB:.1f} GB x {TRAINER_HEADROOM} headroom = {TRAINER_HEADROOM * trainer / GB:.1f} GB, in "
        f"the {rest / GB:.1f} GB left (fix: {'; '.join(fixes)}); nothing was started"
    ]


def _parts(
    cfg: RunConfig, shape: ModelShape, gpu_bytes: int, rows: int, width: int, chunk: int, running: int
) -> dict[str, int]:
    """Bytes per GPU of each part the two turns add up; `running`: the engines' largest batch."""
    world, train = _world(cfg), cfg.train
    compute = 4 if train.mixed_precision == "fp32" else 2  # auto is bf16 on GPU
    total = shape.parameters()
    trainable = total if train.lora is None else shape.lora_parameters(train.lora.rank, train.lora.target_modules)
    frozen = (total if train.lora is not None else 0) + (total if train.kl_coef > 0 and train.lora is None else 0)
    # fp32 master weights (the trainer loads fp32) + Adam's two moments; a frozen base or reference: fp32 only
    state = (12 * trainable + 4 * frozen) // world
    gathered = (shape.embedding_parameters() + 2 * shape.layer_parameters()) * compute  # FSDP2's unsharded copies
    activations = rows * width * shape.activation_bytes_per_token(compute)
    logprobs = min(chunk, rows * width) * shape.vocab * 4 * 3  # fp32 logits of a chunk, their exp and log-softmax
    # foreach AdamW's temporaries, after the activations are freed; on a GPU the trainer runs the fused
    # kernel (train/fsdp.py adamw), which needs less: kept as a margin (never measured smaller)
    optimizer_step = 4 * trainable // world
    engine_bytes, tp = _engine_dtype_bytes(cfg, shape), cfg.rollout.tp_size
    reserve = activation_reserve_bytes(running, shape.vocab)
    embedded = cfg.rollout.backend == "embedded"
    if embedded and train.lora is not None:  # the merged adapter's saved base weights (engine/lora/lora_merge.py)
        reserve += shape.lora_target_weights(train.lora.target_modules) * engine_bytes // tp
    return {
        "trainer_state": state,
        "trainer_gradients": 4 * trainable // world,
        "trainer_peak": max(activations + logprobs + gathered, optimizer_step),
        "engine_weights": total * engine_bytes // tp,
        "engine_inside": reserve if embedded else 0,  # inside mem_fraction_static (the allocator's cap)
        "engine_outside": 0 if embedded else reserve,  # SGLang: activations and graphs beside its fraction
        "contexts": 2 * CONTEXT_BYTES,
        "margin": round(MARGIN * gpu_bytes),
    }


def _overheads(parts: dict[str, int]) -> int:
    return parts["contexts"] + parts["margin"]


def _largest_fraction(parts: dict[str, int], gpu_bytes: int, offload: bool) -> float:
    """What the engines' turn leaves the engine, in hundredths, at most the engines' default."""
    trainer = 0 if offload else parts["trainer_state"]
    room = gpu_bytes - _overheads(parts) - parts["engine_outside"] - trainer
    return max(min(math.floor(100 * room / gpu_bytes) / 100, DEFAULT_GPU_FRACTION), 0.01)


def _width(cfg: RunConfig, prompt_tokens: int) -> int:
    """The longest sample the trainer sees: an episode's budget, or the prompt bound + new tokens."""
    if cfg.grpo.environment:
        return cfg.grpo.agent.max_total_tokens
    return prompt_tokens + cfg.rollout.sampling.max_new_tokens


def _world(cfg: RunConfig) -> int:
    return cfg.trainer.world_size


def _engine_dtype_bytes(cfg: RunConfig, shape: ModelShape) -> int:
    """The checkpoint's dtype (`--dtype auto` on GPU); SGLang serves an fp32 checkpoint in 16 bits."""
    return min(shape.dtype_bytes, 2) if cfg.rollout.backend == "sglang" else shape.dtype_bytes


def _running(cfg: RunConfig, samples: int) -> tuple[int, int | None]:
    """The batch the engines' reserve is sized for, and the --max-running-requests the plan gives them
    (None: none). The user's value (rollout.server_extras) stands; an embedded engine runs the step's
    samples (and dynamic sampling's extras) at once; SGLang's memory beside its fraction is its own."""
    extras = cfg.rollout.server_extras
    for index, arg in enumerate(extras):
        if arg == "--max-running-requests" and index + 1 < len(extras):
            return int(extras[index + 1]), None
        if arg.startswith("--max-running-requests="):
            return int(arg.split("=", 1)[1]), None
    if cfg.rollout.backend != "embedded":
        return GPU_MAX_RUNNING_REQUESTS, None
    extra = cfg.grpo.dynamic_sampling_max_extra * cfg.rollout.sampling.n if cfg.grpo.dynamic_sampling else 0
    running = min(samples + extra, GPU_MAX_RUNNING_REQUESTS)
    return running, running
