"""Pydantic models for a whole run: rollout fleet, trainer, loop, Ray, weight sync.

Every model forbids unknown keys, so a typo is an error, not a silently ignored setting; a bad
value raises FieldProblem in a validator, which rollfleet.config.loading turns into one line.

One job: the sections of one run's config and RunConfig's checks across them (colocation, LoRA, agent,
verification, pipeline weight paths), which read several sections at once; the sections with settings
of their own already live beside it (weight_sync.py, standby.py, lora.py, agent.py, train.py).
"""

from __future__ import annotations

import warnings
from typing import Literal, get_args

from pydantic import Field, field_validator, model_validator

from rollfleet.config.agent import check_agent_run
from rollfleet.config.errors import FieldProblem
from rollfleet.config.grpo import GrpoConfig
from rollfleet.config.lora import check_lora_run
from rollfleet.config.section import Section as _Section
from rollfleet.config.seeding import check_seeding, sampling_seeded
from rollfleet.config.standby import check_standby_beside
from rollfleet.config.train import TrainConfig, TrainerConfig
from rollfleet.config.weight_sync import DiskSync, WeightSyncConfig
from rollfleet.layout import Layout, LayoutError


class SamplingDefaults(_Section):
    """Sampling parameters used when a generate call does not set its own."""

    max_new_tokens: int = Field(128, ge=0, description="Most tokens generated per sample.")
    temperature: float = Field(1.0, ge=0.0, description="Softmax temperature; 0 means greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass; 1 keeps every token.")
    top_k: int = Field(-1, description="Sample among the k most likely tokens; -1 keeps every token.")
    n: int = Field(1, ge=1, description="Samples per prompt (the GRPO group size).")
    stop: list[str] = Field(default_factory=list, description="Strings that end a sample.")
    stop_token_ids: list[int] = Field(default_factory=list, description="Token ids that end a sample.")
    ignore_eos: bool = Field(False, description="Keep generating past the EOS token.")

    @field_validator("top_k")
    @classmethod
    def _top_k_is_off_or_positive(cls, top_k: int) -> int:
        """top_k is -1 (every token) or a positive count: 0 would leave no token to sample."""
        if top_k == -1 or top_k >= 1:
            return top_k
        raise FieldProblem("must be -1 (off) or >= 1", "use -1 to keep every token, or a positive count")


class RolloutConfig(_Section):
    """The engine fleet: how many engines, how each spans GPUs, where they sit."""

    backend: Literal["embedded", "sglang"] = Field(
        "embedded", description="Engine server: rollfleet's embedded engine (CPU, small GPU jobs) or SGLang."
    )
    sglang_command: list[str] = Field(
        default_factory=list,
        description="backend=sglang: the program that starts one SGLang server, before its flags (SGLang pins its "
        "own torch, so it often lives in a venv of its own: [/opt/sglang/bin/python, -m, sglang.launch_server]); "
        "empty: this interpreter's `-m sglang.launch_server`.",
    )
    model_path: str = Field(min_length=1, description="HF model directory (or hub id) the engines load.")
    num_engines: int = Field(1, ge=1, description="Number of engine replicas (data parallel size).")
    standby_engines: int = Field(
        0, ge=0, description="Extra engines started without weights that take a dead engine's place (disaggregated)."
    )
    standby_beside: list[int] = Field(
        default_factory=list,
        description="Standby k lives on the GPUs of serving engine standby_beside[k], memory split by "
        "mem_fraction_static and standby_mem_fraction_static; empty: each standby on GPUs of its own.",
    )
    mem_fraction_static: float | None = Field(
        None, gt=0.0, lt=1.0, description="Share of a GPU's memory one serving engine may use; None: engine default."
    )
    standby_mem_fraction_static: float | None = Field(
        None, gt=0.0, lt=1.0, description="Share of a GPU's memory one standby may use; None: mem_fraction_static."
    )
    engine_launcher: Literal["zygote", "spawn"] = Field(
        "zygote",
        description="zygote: embedded engines fork from a pre-imported launcher per engine (a restart pays no "
        "imports); spawn: a new interpreter per start.",
    )
    tp_size: int = Field(1, ge=1, description="Tensor parallel size of one engine.")
    pp_size: int = Field(1, ge=1, description="Pipeline parallel size of one engine (SGLang only).")
    ep_size: int = Field(1, ge=1, description="Expert parallel size inside one engine's TP group; divides tp_size.")
    placement: Literal["colocated", "disaggregated"] = Field(
        "disaggregated", description="colocated: trainer and engines share GPUs; disaggregated: separate GPUs."
    )
    release_weights: bool | Literal["auto"] = Field(
        "auto",
        description="Colocated: the engines release their weights for the trainer's turn (true) or keep them "
        "on the GPU (false: they release only the KV cache and CUDA graphs, and a push writes into weights "
        "that never left, with no re-allocation before it; their memory must fit beside the trainer's). "
        "auto: the memory plan keeps them when the trainer's turn fits beside them (rollfleet.fleet.memory_plan; "
        "on CPU: release, a LoRA run: keep). Ignored when disaggregated.",
    )
    release_kv_cache: bool | Literal["auto"] = Field(
        "auto",
        description="Colocated: the engines release their KV cache and CUDA graphs for the trainer's turn and "
        "resume them after the push (true), or keep all their memory through it (false: a turn is the push "
        "alone, nothing is released, resumed or re-captured; the engine's share is sized so the trainer's whole "
        "turn fits beside it, and the trainer's allocator is capped at what is left, train.gpu_memory_cap). "
        "auto: the memory plan keeps them when the KV pool still holds the step's samples at once beside the "
        "trainer's turn with its margin (rollfleet.fleet.memory_plan; on CPU: release). false needs "
        "release_weights false. Ignored when disaggregated.",
    )
    gpus_per_worker: float = Field(
        1.0, gt=0.0, le=1.0, description="GPU fraction one rollout worker reserves in Ray (below 1 when colocated)."
    )
    use_gpu: bool = Field(False, description="Run engines on GPUs; False runs them on CPU.")
    sampling: SamplingDefaults = Field(default_factory=SamplingDefaults, description="Default sampling parameters.")
    server_extras: list[str] = Field(
        default_factory=list, description="Extra command-line arguments appended to the engine server's argv."
    )
    api_key: str | None = Field(
        None, repr=False, description="API key the engine servers require (generate, OpenAI, status); None: no auth."
    )
    admin_api_key: str | None = Field(
        None,
        repr=False,
        description="Admin key (SGLang's --admin-api-key): the engines' weight, memory, pause and abort routes then "
        "take only it, not api_key; the fleet's own control calls send it, its generate traffic api_key. "
        "None: those routes take api_key.",
    )
    host: str = Field("127.0.0.1", description="Address engine servers bind; 0.0.0.0 for multi-node (set api_key).")
    request_timeout_s: float = Field(600.0, gt=0.0, description="Seconds one generate request may take.")
    probe_interval_s: float = Field(
        2.0, gt=0.0, description="Seconds between health probes of each ACTIVE or AWAITING_WEIGHTS engine."
    )
    probe_timeout_s: float = Field(
        5.0, gt=0.0, description="A probe slower than this counts as failed (so does a listening engine's start poll)."
    )
    probe_failures: int = Field(
        3,
        ge=1,
        description="Consecutive failed probes that mark an engine INACTIVE; as many unanswered polls of an engine "
        "that listens while it starts fail its start.",
    )
    auto_restart: bool = Field(
        True, description="Restart INACTIVE engines in the background (see Fleet.restart_inactive)."
    )
    restart_backoff_s: float = Field(
        2.0,
        ge=0.0,
        description="An engine whose restarts have not brought it back to serving waits this long before the "
        "next try, doubling with each try (up to restart_backoff_max_s): a restart that fails every time "
        "(a lost GPU, a broken model path) does not stall every step. 0: no wait. "
        "Fleet.restart_inactive(force=True) tries at once.",
    )
    restart_backoff_max_s: float = Field(120.0, ge=0.0, description="The longest wait between restart tries.")
    restore_timeout_s: float = Field(
        120.0,
        gt=0.0,
        description="Seconds a restore (load and verification of a restarted or waiting engine) may take; "
        "then the engines that do not answer /health are killed and the others wait for the next push.",
    )
    recovery_wait_s: float = Field(
        300.0, ge=0.0, description="With no ACTIVE engine, how long generate waits for one to recover before failing."
    )
    startup_timeout_s: float = Field(300.0, gt=0.0, description="Seconds to wait for an engine server to be ready.")
    log_dir: str = Field("logs/engines", description="Directory for engine server logs.")

    @property
    def layout(self) -> Layout:
        """The fleet's shape (engines, tp, pp, ep); valid once this config validated."""
        return Layout(self.num_engines, self.tp_size, self.pp_size, self.ep_size)

    @property
    def keys(self) -> dict[str, str | None]:
        """The engines' keys, as EngineClient and EnginePool take them: each call sends the one its route takes."""
        return {"api_key": self.api_key, "admin_api_key": self.admin_api_key}

    @property
    def seeds_each_sample(self) -> bool:
        """Whether each of a seeded request's n samples needs a seed of its own (SGLang: a request's n
        copies share its seed, and would draw the same tokens; rollfleet.fleet.sampling_seeds)."""
        return self.backend == "sglang"

    @property
    def gpus_per_engine(self) -> int:
        return self.layout.gpus_per_engine

    @property
    def world_size(self) -> int:
        """All rollout ranks (one per GPU): num_engines * tp_size * pp_size."""
        return self.layout.world_size

    @model_validator(mode="after")
    def _check_parallel_sizes(self) -> RolloutConfig:
        """The engine's shape: ep_size divides tp_size; pp_size > 1 only with backend=sglang (the embedded
        engine has no pipeline parallel); standby engines only when disaggregated; standby_beside names one
        serving engine per standby, both memory fractions set, and no GPU's fractions adding up to more than 1.
        Warns that gpus_per_worker is ignored when use_gpu is false."""
        try:
            _ = self.layout  # validates the shape
        except LayoutError as err:
            first = err.problems[0]
            fix = f"set rollout.{first.fix.removeprefix('set ')}"
            raise FieldProblem(first.problem, fix, first.field, first.value) from None
        if self.pp_size > 1 and self.backend == "embedded":
            raise FieldProblem(
                "the embedded engine has no pipeline parallel; use backend=sglang",
                "set rollout.backend=sglang, or rollout.pp_size=1",
                field="pp_size",
                value=self.pp_size,
            )
        if self.standby_engines and self.placement == "colocated":
            raise FieldProblem(
                "standby engines need GPUs of their own (placement=disaggregated); a standby beside a colocated "
                "engine, with its memory released, is not built",
                "set rollout.standby_engines=0, or rollout.placement=disaggregated",
                field="standby_engines",
                value=self.standby_engines,
            )
        check_standby_beside(self)
        if not self.use_gpu and "gpus_per_worker" in self.model_fields_set:
            warnings.warn("rollout.gpus_per_worker is ignored because rollout.use_gpu is false", stacklevel=2)
        return self


class RayConfig(_Section):
    """How to reach Ray; the defaults start a local Ray on this machine."""

    address: str | None = Field(None, description="Ray cluster address ('auto', 'ray://host:10001'); None: local.")
    num_cpus: int | None = Field(None, ge=0, description="CPUs a local Ray may use; None: all.")
    num_gpus: int | None = Field(None, ge=0, description="GPUs a local Ray may use; None: all.")
    temp_dir: str | None = Field(None, description="Ray's session directory; None: Ray's default.")


class RunConfig(_Section):
    """One run: rollout fleet, trainer and Ray."""

    rollout: RolloutConfig = Field(description="The engine fleet.")
    trainer: TrainerConfig = Field(default_factory=TrainerConfig, description="The trainer.")
    ray: RayConfig = Field(default_factory=RayConfig, description="Ray connection.")
    train: TrainConfig = Field(default_factory=TrainConfig, description="The policy trainer.")
    grpo: GrpoConfig = Field(default_factory=GrpoConfig, description="The GRPO loop.")
    weight_sync: WeightSyncConfig = Field(default_factory=DiskSync, description="How weights reach the engines.")

    @model_validator(mode="after")
    def _check_pipeline_weight_path(self) -> RunConfig:
        """With rollout.pp_size > 1, weight_sync.transport is one SGLang can feed to every pipeline stage
        (disk: each stage reads its own layers; tensor, nccl and lora cannot)."""
        problem, transport = self.weight_sync.pipeline_parallel_problem, self.weight_sync.transport
        if self.rollout.pp_size > 1 and problem is not None:
            members = get_args(get_args(WeightSyncConfig)[0])
            able = [m.model_fields["transport"].default for m in members if m.pipeline_parallel_problem is None]
            raise FieldProblem(
                f"SGLang cannot take weights over '{transport}' with pp_size={self.rollout.pp_size} ({problem})",
                f"set weight_sync.transport to one of {able}, or rollout.pp_size=1",
                field="weight_sync.transport",
                value=transport,
            )
        return self

    @model_validator(mode="after")
    def _check_lora(self) -> RunConfig:
        """train.lora needs weight_sync.transport=lora, a rank within weight_sync.max_lora_rank, targets
        within weight_sync.lora_target_modules, rollout.release_weights=false when colocated (nothing pushes
        base weights back) and no full-weight grpo.recovery_checkpoint_every."""
        check_lora_run(self)
        return self

    @model_validator(mode="after")
    def _kept_kv_keeps_weights(self) -> RunConfig:
        """Engines that keep their KV cache through the trainer's turn keep their weights too, and the
        trainer keeps its state on the GPU (both turns' memory is there at once)."""
        rollout = self.rollout
        if rollout.release_kv_cache is False and rollout.release_weights is True:
            raise FieldProblem(
                "rollout.release_kv_cache=false keeps all the engines' memory through the trainer's turn, "
                "their weights included",
                "set rollout.release_weights=false (or auto), or rollout.release_kv_cache=true",
                field="rollout.release_weights",
                value=True,
            )
        if rollout.release_kv_cache is False and self.train.offload is True:
            raise FieldProblem(
                "rollout.release_kv_cache=false keeps the engines' and the trainer's memory on the GPU at once; "
                "train.offload=true moves the trainer's state to the host for the engines' turn",
                "set train.offload=false (or auto), or rollout.release_kv_cache=true",
                field="train.offload",
                value=True,
            )
        if rollout.release_kv_cache is False and rollout.release_weights == "auto":
            rollout.release_weights = False
        return self

    @model_validator(mode="after")
    def _lora_keeps_base_weights(self) -> RunConfig:
        """A LoRA run never pushes base weights: its `auto` keeps them, with or without a memory plan."""
        if self.train.lora is not None and self.rollout.release_weights == "auto":
            self.rollout.release_weights = False
        return self

    @model_validator(mode="after")
    def _check_agent(self) -> RunConfig:
        """grpo.environment: no train.routing_replay (an episode is many engine answers), and a turn of
        rollout.sampling.max_new_tokens leaves room within grpo.agent.max_total_tokens; warns that
        grpo.reward is ignored (the environment rewards each episode)."""
        check_agent_run(self)
        return self

    @model_validator(mode="after")
    def _check_verification(self) -> RunConfig:
        """weight_sync.verify=fingerprint only with the embedded engine (SGLang has no fingerprint route)."""
        if self.rollout.backend == "sglang" and self.weight_sync.verify == "fingerprint":
            raise FieldProblem(
                "SGLang has no /rollfleet/weights_fingerprint route (an embedded-engine extension), so syncs "
                "to it cannot be verified by fingerprint",
                "set weight_sync.verify=version (each engine's weight version is checked) or auto, or use "
                "rollout.backend=embedded",
                field="weight_sync.verify",
                value="fingerprint",
            )
        return self

    @property
    def verify_mode(self) -> str:
        """'fingerprint' or 'version': weight_sync.verify with 'auto' resolved for the backend."""
        if self.weight_sync.verify != "auto":
            return self.weight_sync.verify
        return "version" if self.rollout.backend == "sglang" else "fingerprint"

    @model_validator(mode="after")
    def _check_seeding(self) -> RunConfig:
        """grpo.seed_sampling=true with backend=sglang needs its deterministic inference (SGLang ignores
        the seeds without it); grpo.seed_sampling=false with SGLang's deterministic inference and
        rollout.sampling.n > 1 is refused (a prompt's samples would all be the same)."""
        check_seeding(self)
        return self

    @property
    def sampling_seed(self) -> int | None:
        """grpo.seed when the engines' sampling is seeded from it (grpo.seed_sampling, 'auto' resolved
        for the backend), else None."""
        return self.grpo.seed if sampling_seeded(self) else None

    @property
    def recovery_snapshot_every(self) -> int:
        """grpo.recovery_checkpoint_every with 'auto' resolved: every step for a single-engine fleet (a
        dead lone engine leaves generate nothing to run on, so no push could come to restore it), never
        with 2+ engines (a peer, or the trainer's next push, restores one)."""
        every = self.grpo.recovery_checkpoint_every
        if every != "auto":
            return every
        # a LoRA run restores from the base weights and the adapter its syncs leave on disk
        return 1 if self.rollout.num_engines == 1 and self.train.lora is None else 0

    @model_validator(mode="after")
    def _check_colocation(self) -> RunConfig:
        """placement=colocated (engines and trainer share each GPU): grpo.max_staleness=0 (no generating while
        the trainer trains), no trainer sequence parallel beside engines spanning several GPUs, and
        trainer.world_size equal to the rollout world size (one trainer rank and one rollout rank per GPU)."""
        rollout, trainer = self.rollout, self.trainer
        if rollout.placement != "colocated":
            return self
        if self.grpo.max_staleness:
            raise FieldProblem(
                "asynchronous steps generate while the trainer trains, and colocated engines and trainer share "
                "each GPU (the engines release it for the trainer's turn)",
                "set grpo.max_staleness=0, or rollout.placement=disaggregated",
                field="grpo.max_staleness",
                value=self.grpo.max_staleness,
            )
        if trainer.sequence_parallel_size > 1 and rollout.gpus_per_engine > 1:
            raise FieldProblem(
                "sequence parallel on the train side cannot combine with rollout "
                f"tp_size*pp_size={rollout.gpus_per_engine} on the same workers (placement=colocated)",
                "set trainer.sequence_parallel_size=1, or rollout.tp_size=1 and rollout.pp_size=1, "
                "or rollout.placement=disaggregated",
                field="trainer.sequence_parallel_size",
                value=trainer.sequence_parallel_size,
            )
        if trainer.world_size != rollout.world_size:
            raise FieldProblem(
                f"must equal the rollout world size num_engines*tp_size*pp_size={rollout.world_size} "
                "when placement=colocated (each GPU holds one trainer rank and one rollout rank)",
                f"set trainer.world_size={rollout.world_size}, change rollout.num_engines, "
                "or set rollout.placement=disaggregated",
                field="trainer.world_size",
                value=trainer.world_size,
            )
        return self
