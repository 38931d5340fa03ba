"""The trainer's sections of a run's config: the trainer's ranks (`trainer`) and what it trains and
how (`train`), read by the FSDP2 trainer (rollfleet.train) and the memory plan."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from rollfleet.config.errors import FieldProblem
from rollfleet.config.lora import LoraTrainConfig
from rollfleet.config.section import Section as _Section
from rollfleet.layout import divisors


class TrainerConfig(_Section):
    """The trainer side, as far as layout validation needs it."""

    world_size: int = Field(1, ge=1, description="Number of trainer ranks (FSDP world size).")
    sequence_parallel_size: int = Field(1, ge=1, description="Ranks one sequence is split over; divides world_size.")

    @model_validator(mode="after")
    def _check_sequence_parallel(self) -> TrainerConfig:
        """sequence_parallel_size divides world_size: each sequence is split over a whole group of ranks."""
        if self.world_size % self.sequence_parallel_size:
            raise FieldProblem(
                f"must divide trainer.world_size={self.world_size}",
                f"set trainer.sequence_parallel_size to one of {divisors(self.world_size)}",
                field="sequence_parallel_size",
                value=self.sequence_parallel_size,
            )
        return self


class TrainConfig(_Section):
    """The policy trainer: optimizer, loss and precision."""

    lr: float = Field(1e-5, gt=0.0, description="AdamW learning rate (constant).")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW decoupled weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW (beta1, beta2).")
    micro_batch_size: int = Field(
        8, ge=1, description="Samples per forward/backward on one rank (gradient accumulation)."
    )
    grad_clip: float = Field(1.0, ge=0.0, description="Clip the global gradient norm to this; 0 turns clipping off.")
    clip_low: float = Field(0.2, ge=0.0, lt=1.0, description="Ratio clip below: ratio >= 1 - clip_low.")
    clip_high: float = Field(
        0.28, ge=0.0, description="Ratio clip above: ratio <= 1 + clip_high (0.28 is DAPO's clip-higher)."
    )
    token_level_loss: bool = Field(
        True, description="Average the loss over every token of the batch; False: per sample, then over samples."
    )
    scale_adv_by_std: bool = Field(
        True, description="Divide group advantages by the group's reward std (False: Dr. GRPO)."
    )
    kl_coef: float = Field(
        0.0,
        ge=0.0,
        description="Weight of the k3 KL to a frozen reference model; 0 loads no reference. With train.lora the "
        "reference is the base model with the adapter disabled, in the same module (no second copy).",
    )
    tis_cap: float = Field(
        2.0,
        ge=0.0,
        description="Truncated importance sampling: each token's policy-gradient weight is "
        "min(exp(trainer old logprob - engine logprob), tis_cap), the engines being the behaviour policy; 0: off.",
    )
    mixed_precision: Literal["auto", "fp32", "bf16"] = Field(
        "auto",
        description="Compute dtype: auto = bf16 on GPU, fp32 on CPU; bf16 needs a GPU. Master weights stay fp32.",
    )
    offload: bool | Literal["auto"] = Field(
        "auto",
        description="Colocated on GPU: the trainer's parameters and optimizer state go to host memory for the "
        "engines' turn and come back for training (reused pinned buffers). false: they stay on the GPU and "
        "nothing is copied (the engines' memory must fit beside them); the engines still release theirs for "
        "the trainer's turn. auto: the memory plan keeps them when the engines' KV pool still holds the step's "
        "samples at once beside them (rollfleet.fleet.memory_plan). Ignored when disaggregated and on CPU.",
    )
    gpu_memory_cap: float | None = Field(
        None,
        gt=0.0,
        le=1.0,
        description="Colocated on GPU: the trainer's CUDA allocator never holds more than this fraction of the "
        "GPU (torch.cuda.set_per_process_memory_fraction: past it, it frees its cache and retries before it "
        "fails). The memory plan sets it when the engines keep their memory through the trainer's turn "
        "(rollout.release_kv_cache); None: uncapped.",
    )
    logprob_chunk: int = Field(
        1024,
        ge=1,
        description="Token positions whose logits the trainer builds at once for its log-probs (forward, and "
        "again in backward): the logits' peak is logprob_chunk x vocab in float32, not rows x width x vocab. "
        "Any value gives the same log-probs; larger: fewer head calls, more memory.",
    )
    seed: int = Field(0, description="Torch seed set before the model is built.")
    lora: LoraTrainConfig | None = Field(
        None, description="Train a LoRA adapter (peft) instead of the full weights; needs weight_sync.transport=lora."
    )
    compile: bool = Field(
        False,
        description="torch.compile each decoder layer's forward (inductor on a GPU), fusing the elementwise work "
        "around its products (norms, rotary, activation, casts); names, checkpoints and syncs are unchanged. "
        "Each new micro-batch shape compiles once (seconds to tens of seconds; later shapes compile with dynamic "
        "sizes). Not with routing_replay (its hooks feed each call the engine's choices).",
    )
    routing_replay: bool = Field(
        False,
        description="MoE only: the trainer's forward uses the experts the engine chose for each token (SGLang's "
        "routed_experts; engines get --enable-return-routed-experts) instead of its own top-k.",
    )

    @model_validator(mode="after")
    def _check_compile(self) -> TrainConfig:
        """compile: not with routing_replay, whose hooks inside the layers feed each call its own choices."""
        if self.compile and self.routing_replay:
            raise FieldProblem(
                "cannot be combined with train.routing_replay (its router hooks give every forward the engine's "
                "expert choices, state a compiled layer would not see)",
                "set train.compile=false, or train.routing_replay=false",
                field="compile",
                value=self.compile,
            )
        return self
