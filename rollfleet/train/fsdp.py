"""FSDP2 policy trainer: one `PolicyTrainer` per rank, driven in lockstep by its caller.

Process group. The CALLER initialises torch.distributed before building a trainer (a Ray actor, a
`torch.multiprocessing` worker or `torchrun`; sharding.py's `init_distributed` is the short way) and
destroys it afterwards. The trainer builds a 1-D device mesh over the whole default group and
shards every decoder layer, then the root, with `fully_shard`. Runtime objects are never config.

Lockstep. Every public method that touches parameters (`train_step`, `weight_source().named_tensors()`,
`save_hf`, `save_state`, `load_state`) runs collectives: every rank calls it, in the same order,
with the same arguments. `train_step` takes the WHOLE batch on every rank; rank r trains on items
r::world_size, and ranks with fewer items run zero-weight padding micro-batches so the collectives
line up.

Loss. One optimizer step per batch, so the trainer's forward pass before the step gives the old
policy's logprobs. With `tis_cap > 0` (truncated importance sampling) the ratio starts from them,
and each token's policy-gradient term is weighted by min(exp(trainer - engine), tis_cap): the
engines' logprobs are the behaviour policy (older weights in an asynchronous run). With
`tis_cap == 0` the ratio starts from the ENGINE's logprobs, uncorrected. With the ratio ~1 (a
synchronous run, fp32) both give the same gradient. Every step measures the engine/trainer
mismatch (`logprob_mismatch_*`) and the TIS ratio (`tis_ratio_mean/max`, `tis_truncated_share`).
The loss is normalised by the whole batch's token count (or sequence count), and multiplied by
world_size to undo FSDP's gradient averaging, so world sizes and micro-batch sizes give the same update.

LoRA (`train.lora`): the policy is wrapped with peft before sharding (rollfleet.train.lora); only the
adapter trains, sits in the optimizer and in the resumable state, and leaves as the weight source and
the saved model; the KL reference is the same module with the adapter disabled.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from rollfleet.config import TrainConfig
from rollfleet.train import lora, trainer_files
from rollfleet.train.batch import check_batch, collate, trained_tokens
from rollfleet.train.grpo import logprob_mismatch, policy_loss, truncated_is_weights
from rollfleet.train.offload import Offloader, give_back
from rollfleet.train.routing_replay import RoutingReplay
from rollfleet.train.sharding import compute_dtype_for, default_device, load_sharded
from rollfleet.train.token_logprobs import ChunkedHead
from rollfleet.weights.adapter import LoraSource
from rollfleet.weights.source import ModuleSource
from rollfleet.wire.protocol import GREEDY_TEMPERATURE


class PolicyTrainer:
    """A HF causal LM sharded with FSDP2, trained with the clipped GRPO loss (see the module docstring)."""

    def __init__(
        self, model_path: str | Path, config: TrainConfig | None = None, *, device=None, sampling_temperature=1.0
    ):
        """`sampling_temperature`: the engines'; logprobs are of logits / it, as theirs (greedy: raw)."""
        self.config = config or TrainConfig()
        self.temperature = sampling_temperature if sampling_temperature >= GREEDY_TEMPERATURE else 1.0
        self.model_path = Path(model_path)
        self.device = torch.device(device) if device is not None else default_device()
        self.compute_dtype = compute_dtype_for(self.config.mixed_precision, self.device)
        if not dist.is_initialized():
            raise RuntimeError(
                "PolicyTrainer needs torch.distributed initialised first "
                "(fix: call rollfleet.train.sharding.init_distributed(rank, world_size, ...) on every rank)"
            )
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        if self.config.gpu_memory_cap is not None and self.device.type == "cuda":  # the engines stay beside it
            torch.cuda.set_per_process_memory_fraction(self.config.gpu_memory_cap, self.device)
        torch.manual_seed(self.config.seed)
        self.lora = self.config.lora is not None
        self.mesh = init_device_mesh(self.device.type, (self.world_size,), mesh_dim_names=("fsdp",))
        self.model = self._load_sharded(trainable=True)
        # a LoRA run's reference is the same module with the adapter disabled (`_reference`)
        self.ref_model = self._load_sharded(trainable=False) if self.config.kl_coef > 0 and not self.lora else None
        # the engine's expert choices in every forward (routing_replay.py)
        self.replays = {id(m): RoutingReplay(m) for m in self._models() if self.config.routing_replay}
        # log-probs from the head's input, logprob_chunk positions at a time (rollfleet.train.token_logprobs)
        self.heads = {id(m): ChunkedHead(m, self.config.logprob_chunk) for m in self._models()}
        self.optimizer = adamw(self.model, self.config)
        self.step = 0
        self.pad_token_id = self.model.config.pad_token_id or 0
        self._offloaded = False
        self._offloader = Offloader(self.device)

    # ---------------------------------------------------------------- build

    def _load_sharded(self, *, trainable: bool) -> torch.nn.Module:
        lora_config = self.config if trainable and self.lora else None
        return load_sharded(
            self.model_path,
            self.mesh,
            self.compute_dtype,
            trainable=trainable,
            lora_config=lora_config,
            compile_layers=self.config.compile,
        )

    # ---------------------------------------------------------------- training

    def train_step(self, batch: Sequence[Mapping[str, Any]]) -> dict[str, float]:
        """One optimizer step on `batch` (the same full list on every rank).

        Each item: `prompt_ids` and `output_ids` (token id lists), `logprobs` (the engine's logprob
        of each output token, len(output_ids) floats), `advantage` (a float), optionally `loss_mask`
        (an episode's: 1 for the policy's output tokens, the only ones trained); with routing replay also
        `routed_experts` (SGLang's base64, every position but the last). Returns metrics reduced over
        ranks: loss, grad_norm, clip_frac, ratio_mean, kl, logprob_mismatch_mean/max, tis_ratio_mean/max,
        tis_truncated_share, tokens, samples, step; with replay replay_routes, replay_changed_share; on a
        GPU peak_reserved_gb (this rank's allocator, the step's peak).
        """
        check_batch(batch)
        replay = self.replays.get(id(self.model))
        if replay is not None:
            replay.check(batch)
        self._require_onloaded("train_step")
        cfg = self.config
        per_rank = math.ceil(len(batch) / self.world_size)
        local: list[Mapping[str, Any] | None] = list(batch[self.rank :: self.world_size])
        local += [None] * (per_rank - len(local))  # zero-weight padding: every rank runs as many passes
        trained = [trained_tokens(item) for item in batch]  # an episode's: the policy's tokens only
        normalizer = sum(trained) if cfg.token_level_loss else sum(1 for count in trained if count)
        sums = [0.0] * 8  # loss, clipped, ratio, kl, mismatch, tis ratio, tis truncated (token-weighted), tokens
        worst = [0.0, 0.0]  # mismatch max, tis ratio max
        for start in range(0, per_rank, cfg.micro_batch_size):
            values, maxima = self._micro_step(local[start : start + cfg.micro_batch_size], normalizer)
            sums = [total + value for total, value in zip(sums, values, strict=True)]
            worst = [max(a, b) for a, b in zip(worst, maxima, strict=True)]
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip or math.inf)
        if isinstance(grad_norm, DTensor):
            grad_norm = grad_norm.full_tensor()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return {
            **self._reduced(sums, worst),
            "grad_norm": float(grad_norm),
            "samples": len(batch),
            "step": self.step,
            **(replay.figures(self.device) if replay is not None else {}),
            **self._peak_reserved(),
        }

    def _peak_reserved(self) -> dict[str, float]:
        """GB the allocator reserved at most since the last step's (what train.gpu_memory_cap must hold)."""
        if self.device.type != "cuda":
            return {}
        peak = torch.cuda.max_memory_reserved(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        return {"peak_reserved_gb": peak / 1e9}

    def _micro_step(self, items: Sequence[Mapping[str, Any] | None], normalizer: float) -> tuple[tuple, float]:
        """Forward and backward of one micro-batch; its token-weighted figures and worst mismatch and
        TIS ratio."""
        cfg = self.config
        micro = self._collate(items)
        logprobs = self._logprobs(self.model, micro)
        engine = micro["old_logprobs"]
        weights, tis = truncated_is_weights(logprobs, engine, micro["mask"], cfg.tis_cap)
        ref_logprobs = None
        if cfg.kl_coef > 0:
            with torch.no_grad(), self._reference() as reference:
                ref_logprobs = self._logprobs(reference, micro)
        loss, stats = policy_loss(
            logprobs,
            logprobs.detach() if cfg.tis_cap > 0 else engine,
            micro["advantages"],
            micro["mask"],
            clip_low=cfg.clip_low,
            clip_high=cfg.clip_high,
            token_level=cfg.token_level_loss,
            ref_logprobs=ref_logprobs,
            kl_coef=cfg.kl_coef,
            normalizer=normalizer,
            tis_weights=weights if cfg.tis_cap > 0 else None,
        )
        (loss * self.world_size).backward()  # FSDP averages gradients over ranks; the loss is already global
        mismatch = logprob_mismatch(engine, logprobs, micro["mask"])
        tokens = stats["tokens"]
        per_token = (stats["clip_frac"], stats["ratio_mean"], stats["kl"], mismatch["mean"], tis["ratio_mean"])
        values = (float(loss.detach()), *(v * tokens for v in per_token), tis["truncated_share"] * tokens, tokens)
        return values, (mismatch["max"], tis["ratio_max"])

    def _reference(self):
        """The KL term's reference policy, as a context: the frozen copy, or (LoRA) this module with
        the adapter disabled."""
        if self.ref_model is not None:
            return contextlib.nullcontext(self.ref_model)
        return _disabled_adapter(self.model)

    def _reduced(self, sums: list[float], maxima: list[float]) -> dict[str, float]:
        """The step's figures summed (worst mismatch and TIS ratio: max) over ranks, per token."""
        totals = torch.tensor(sums, dtype=torch.float64, device=self.device)  # NCCL reduces device tensors only
        worst = torch.tensor(maxima, dtype=torch.float64, device=self.device)
        dist.all_reduce(totals, op=dist.ReduceOp.SUM)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        loss_sum, clipped, ratio, kl, mismatch_sum, tis_sum, truncated, tokens = totals.tolist()
        per_token = max(tokens, 1.0)
        return {
            "loss": loss_sum,
            "clip_frac": clipped / per_token,
            "ratio_mean": ratio / per_token,
            "kl": kl / per_token,
            "logprob_mismatch_mean": mismatch_sum / per_token,
            "logprob_mismatch_max": float(worst[0]),
            "tis_ratio_mean": tis_sum / per_token,
            "tis_ratio_max": float(worst[1]),
            "tis_truncated_share": truncated / per_token,
            "tokens": int(tokens),
        }

    def _collate(self, items: Sequence[Mapping[str, Any] | None]) -> dict[str, torch.Tensor]:
        routes_shape = self.replays[id(self.model)].shape if self.replays else None
        return {key: value.to(self.device) for key, value in collate(items, self.pad_token_id, routes_shape).items()}

    def _logprobs(self, model: torch.nn.Module, micro: dict[str, torch.Tensor]) -> torch.Tensor:
        """log p(token p+1 | tokens <= p) in fp32, shape [rows, width-1], of logits / the sampling
        temperature like the engines' logprobs (SGLang's convention), the logits built
        `train.logprob_chunk` positions at a time; with routing replay the MoE layers take the engine's experts."""
        replay, head = self.replays.get(id(model)), self.heads[id(model)]
        with replay.forcing(micro["routes"]) if replay is not None else contextlib.nullcontext():
            with head.scoring(micro["input_ids"], self.temperature):
                output = model(input_ids=micro["input_ids"], attention_mask=micro["attention_mask"])
        return head.logprobs(output)

    # ---------------------------------------------------------------- weights out

    def weight_source(self, dtype: torch.dtype | None = None, *, keep: bool | None = None) -> ModuleSource:
        """Full tensors in checkpoint naming, kept on rank 0 (`keep=True`: on every rank); every rank
        must iterate it together. `dtype`: the engines' dtype, cast to on each shard before gathering.
        A LoRA run's source is its adapter alone (peft naming, the trainer's dtype: no cast)."""
        self._require_onloaded("weight_source")
        if self.lora:
            return LoraSource(self.model, keep=self.rank == 0 if keep is None else keep)
        # its parameters stay where they are between steps unless the trainer offloads them
        stays = self.device.type == "cpu" or self.config.offload is False
        return ModuleSource(self.model, keep=self.rank == 0 if keep is None else keep, dtype=dtype, stays=stays)

    def save_hf(self, path: str | Path, *, dtype: torch.dtype | None = None, max_shard_bytes: int = 5 * 2**30) -> None:
        """Write an HF model directory (rank 0 writes; every rank must call).

        Weights come from `weight_source()` (checkpoint names), in `dtype` (default: the fp32 master
        weights), as `model.safetensors` or, beyond `max_shard_bytes`, `model-0000i-of-0000n.safetensors`
        plus `model.safetensors.index.json`; config from the model; tokenizer and generation config
        copied from the directory the trainer loaded.
        """
        self._require_onloaded("save_hf")
        path = Path(path)
        if self.lora:  # the adapter in peft's layout; its config names the base model it trains on
            lora.save_adapter_dir(self.model, path, keep=self.rank == 0)
            return dist.barrier()
        trainer_files.save_hf_dir(
            self.model,
            self.weight_source(),
            path,
            model_path=self.model_path,
            rank=self.rank,
            dtype=dtype,
            max_shard_bytes=max_shard_bytes,
        )

    # ---------------------------------------------------------------- resumable state

    def save_state(self, path: str | Path, extra: Mapping[str, Any] | None = None) -> None:
        """Model + optimizer (sharded, torch.distributed.checkpoint: every rank writes its own shard,
        so `path` must be one directory every rank can reach) and the step; `extra` (JSON) rides along."""
        self._require_onloaded("save_state")
        path = Path(path)
        meta = {"step": self.step, "world_size": self.world_size, "extra": dict(extra or {})}
        trainer_files.save_state(
            self.model, self.optimizer, path, options=trainer_files.state_options(self.lora), rank=self.rank, meta=meta
        )

    def load_state(self, path: str | Path) -> dict[str, Any]:
        """Restore what `save_state` wrote (any world size; DCP reshards) and return its `extra`."""
        self._require_onloaded("load_state")
        path = Path(path)
        options = trainer_files.state_options(self.lora)
        meta = trainer_files.load_state(self.model, self.optimizer, path, options=options)
        self.step = int(meta["step"])
        return meta["extra"]

    # ---------------------------------------------------------------- colocation

    def offload(self) -> dict:
        """The end of a colocated turn: parameters and optimizer state to host buffers reused across
        steps (no move on CPU or with train.offload=false; a run's plan resolved `auto`, and a trainer
        built without one offloads), then, either way, the cached device memory given back for the
        engines (rollfleet.train.offload.give_back). Returns the bytes moved and seconds, and `memory`:
        allocated/reserved bytes before and after (None on CPU)."""
        return give_back(self.device, self._offload)

    def _offload(self) -> dict:
        if self.device.type == "cpu" or self._offloaded or self.config.offload is False:
            return {"bytes": 0, "seconds": 0.0, "host_allocations": 0}
        moved = self._offloader.offload(self._models(), self.optimizer)
        self._offloaded = True
        return moved

    def onload(self) -> dict:
        """Back to the trainer's device after `offload`; bytes moved and seconds. No-op on CPU."""
        if self.device.type == "cpu" or not self._offloaded:
            return {"bytes": 0, "seconds": 0.0, "host_allocations": 0}
        moved = self._offloader.onload(self._models(), self.optimizer)
        self._offloaded = False
        return moved

    def _models(self) -> list[torch.nn.Module]:
        return [m for m in (self.model, self.ref_model) if m is not None]

    def _require_onloaded(self, verb: str) -> None:
        if self._offloaded:
            raise RuntimeError(f"{verb} on an offloaded trainer (fix: call onload() first)")


def adamw(model: torch.nn.Module, config: TrainConfig, **options) -> torch.optim.AdamW:
    """The trainer's optimizer over `model` (with LoRA only the adapter requires grad); `options` go to
    AdamW as they are. On a GPU it is the fused kernel (one pass over parameters, gradients and both
    moments): the 2.08B bench step's train phase took 0.262 s with it against 0.305 s with foreach's
    (scripts/gpu_profile_train_step.py, H100, 2026-12-06); the update's formula is the same."""
    options.setdefault("fused", next(model.parameters()).device.type == "cuda")
    return torch.optim.AdamW(
        lora.param_groups(model, config), lr=config.lr, betas=config.betas, weight_decay=config.weight_decay, **options
    )


@contextlib.contextmanager
def _disabled_adapter(model: torch.nn.Module):
    with model.disable_adapter():
        yield model
