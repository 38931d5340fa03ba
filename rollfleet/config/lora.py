"""`train.lora`: the trainer trains a LoRA adapter (peft) instead of the full weights, and only the
adapter moves to the engines (`weight_sync.transport: lora`). What a LoRA run needs of the rest of
the config is checked here, once (`check_lora_run`); the targets are checked against the model
itself when the run starts (rollfleet.train.lora.check_targets), since the model may not exist yet
when the config is read."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rollfleet.config.errors import FieldProblem
from rollfleet.config.section import Section


class LoraTrainConfig(Section):
    """The adapter the trainer trains (peft's LoraConfig: plain LoRA, no bias, no DoRA)."""

    rank: int = Field(8, ge=1, description="LoRA rank r (peft's r); at most weight_sync.max_lora_rank.")
    alpha: float = Field(16.0, gt=0.0, description="LoRA alpha; the update is scaled by alpha / rank.")
    a_lr_scale: float = Field(
        1.0,
        gt=0.0,
        description="The random factors' learning rate as a share of train.lr (which the zero-initialised factors "
        "and everything else take). Below 1 is LoRA+ (Hayou et al., 2024; their lr_B / lr_A = 16 is 0.0625): the "
        "random factor stays near its init while the other learns on it, so the update's directions grow side by "
        "side instead of the strongest alone. The random factor is A of a linear target and B of embed_tokens "
        "(peft's Embedding swaps the roles: A [r, vocab] starts at 0, B [dim, r] random).",
    )
    a_init: Literal["peft", "orthonormal"] = Field(
        "peft",
        description="How the random factors start: A of a linear target, B of embed_tokens (the other factor starts "
        "at 0 either way, so the adapter starts as the base model). peft: its default (A Kaiming-uniform; "
        "embed_tokens' B standard normal). orthonormal: A's rows orthonormal (its columns where rank > in "
        "features), embed_tokens' B's columns orthonormal (its rows where rank > hidden size): every direction "
        "the factor spans learns at one rate. At rank = a layer's width peft's A is a random square matrix whose "
        "smallest singular values are near 0, so B barely learns along those input directions; orthonormal A "
        "with alpha = rank makes B's Adam steps move the weight as a full run's would, in a rotated basis "
        "(docs/benchmarks.md, `make demo-lora`); so does an orthonormal B for the embedding's rows.",
    )
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the adapter's input while training.")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
        min_length=1,
        description="Names of the modules that get an adapter (the last part of a module's name, e.g. q_proj): "
        "nn.Linear modules, and embed_tokens (the input embedding; peft saves its factors as lora_embedding_A/B); "
        "checked against the model when the run starts (not tied lm_head or embed_tokens, not fused MoE "
        "experts). embed_tokens needs rollout.tp_size 1 on the embedded engine.",
    )

    def peft_config(self):
        """peft's LoraConfig for these settings."""
        from peft import LoraConfig  # imported here: peft takes seconds to import

        return LoraConfig(
            r=self.rank,
            lora_alpha=self.alpha,
            lora_dropout=self.dropout,
            target_modules=list(self.target_modules),
            bias="none",
        )


def check_lora_run(cfg) -> None:
    """train.lora needs weight_sync.transport=lora, and engines that can serve the adapter (cfg: a
    RunConfig, which imports this module: untyped here, as in rollfleet.config.agent)."""
    lora, sync = cfg.train.lora, cfg.weight_sync
    if lora is None:  # a fleet may take a LoRA transport for a trainer of its own; `rollfleet train` refuses it
        return
    if sync.transport != "lora":
        raise FieldProblem(
            "a LoRA run moves only its adapter to the engines",
            "set weight_sync.transport=lora, or remove train.lora to train the full weights",
            field="weight_sync.transport",
            value=sync.transport,
        )
    if lora.rank > sync.max_lora_rank:
        raise FieldProblem(
            f"the engines accept adapters of rank <= weight_sync.max_lora_rank={sync.max_lora_rank}",
            f"set train.lora.rank <= {sync.max_lora_rank}, or weight_sync.max_lora_rank >= {lora.rank}",
            field="train.lora.rank",
            value=lora.rank,
        )
    _check_embedding_target(cfg)
    _check_sglang_stacking(cfg)
    outside = sorted(set(lora.target_modules) - set(sync.lora_target_modules or lora.target_modules))
    if outside:
        raise FieldProblem(
            f"targets {outside} are not in weight_sync.lora_target_modules={sync.lora_target_modules} "
            "(the engines would refuse the adapter)",
            "add them to weight_sync.lora_target_modules, or leave it unset",
            field="train.lora.target_modules",
            value=lora.target_modules,
        )
    _check_memory_moves(cfg)


def _check_embedding_target(cfg) -> None:
    """The embedded engine serves an embed_tokens adapter at tp 1 only (engine/lora/targets.py)."""
    lora, rollout = cfg.train.lora, cfg.rollout
    if "embed_tokens" in lora.target_modules and rollout.backend == "embedded" and rollout.tp_size > 1:
        raise FieldProblem(
            f"the embedded engine serves an adapter on embed_tokens at tp 1 only (rollout.tp_size={rollout.tp_size})",
            "drop embed_tokens from train.lora.target_modules, or set rollout.tp_size=1, or rollout.backend=sglang",
            field="train.lora.target_modules",
            value=lora.target_modules,
        )


def _check_sglang_stacking(cfg) -> None:
    """SGLang 0.5.23 stacks a layer's q, k and v factors into one qkv_proj when it loads an adapter
    (LoRAAdapter.normalize_qkv_proj), filling a missing k with zeros but reading v unconditionally:
    an adapter on q_proj without v_proj fails its load with a KeyError (tests/test_sglang_contract.py)."""
    lora, rollout = cfg.train.lora, cfg.rollout
    if rollout.backend == "sglang" and "q_proj" in lora.target_modules and "v_proj" not in lora.target_modules:
        raise FieldProblem(
            "SGLang 0.5.23 loads an adapter on q_proj only beside one on v_proj (it stacks q, k and v, and "
            "fails on a missing v)",
            "add v_proj to train.lora.target_modules, or set rollout.backend=embedded",
            field="train.lora.target_modules",
            value=lora.target_modules,
        )


def _check_memory_moves(cfg) -> None:
    """Nothing of a LoRA run ever sends base weights: the engines keep theirs for the whole run."""
    rollout = cfg.rollout
    if rollout.placement == "colocated" and rollout.release_weights is True:  # auto: the plan keeps them
        raise FieldProblem(
            "a LoRA run never pushes base weights, so colocated engines must keep theirs for the trainer's "
            "turn (they release only the KV cache)",
            "set rollout.release_weights=false, or rollout.placement=disaggregated",
            field="rollout.release_weights",
            value=True,
        )
    every = cfg.grpo.recovery_checkpoint_every
    if every != "auto" and every > 0:
        raise FieldProblem(
            "a LoRA run restores engines from their base weights and the adapter each sync leaves on disk "
            "(weight_sync.path); a full-weight recovery checkpoint is never used",
            "set grpo.recovery_checkpoint_every to 'auto' or 0",
            field="grpo.recovery_checkpoint_every",
            value=every,
        )


def engine_sync_spec(cfg):
    """`weight_sync` as the engines are started with it (their flags: the transport's `server_args`):
    a LoRA run's `train.lora.target_modules` stand for an unset `weight_sync.lora_target_modules`, so
    an engine's `--lora-target-modules` names what the trainer trains. SGLang needs them listed, and
    the embedded engine reserves room for saving the base of exactly those weights while an adapter
    is merged (unset: of every targetable weight, more than the memory plan counts)."""
    sync, lora = cfg.weight_sync, cfg.train.lora
    if lora is None or sync.transport != "lora" or sync.lora_target_modules is not None:
        return sync
    return sync.model_copy(update={"lora_target_modules": list(lora.target_modules)})
