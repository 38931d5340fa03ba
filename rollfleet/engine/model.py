"""The model inside one tensor-parallel rank of the embedded engine: loading, prefill and decode
with a KV cache, weight reads, memory release and resume.

Every method called through `Action` (lockstep.py) is a *lockstep action*: tp rank 0 decides,
broadcasts the action with its arguments, and every rank runs the same method in the same order.
Methods that use collectives (weight updates, full tensors, fingerprints) rely on that. Weight
updates live in `self.weights` (weight_update.py), LoRA adapters in `self.lora` (lora_merge.py),
which is also the only handle on the parameters.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import tempfile
import time

import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache
from transformers.distributed import DistributedConfig

from rollfleet.engine.load_prints import LoadPrints
from rollfleet.engine.lora import LoraLimits
from rollfleet.engine.lora_merge import LoraMerge
from rollfleet.engine.ranks import Ranks
from rollfleet.engine.remote_instance import RemoteInstance
from rollfleet.engine.shards import full_of, local_of, tensor_sha256
from rollfleet.engine.weight_groups import WeightGroups, WeightUpdateError
from rollfleet.engine.weight_update import SYNC_TIMING, WeightSchema, WeightUpdater
from rollfleet.wire.fingerprint import Fingerprints
from rollfleet.wire.naming import model_to_checkpoint

log = logging.getLogger("rollfleet.engine")
WEIGHT_TAG, KV_CACHE_TAG = "weights", "kv_cache"


class ModelRunner:
    def __init__(
        self,
        model_path: str,
        *,
        tp_size: int = 1,
        ep_size: int = 1,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        dummy: bool = False,
        group=None,
        seed: int = 0,
        lora: LoraLimits | None = None,
    ):
        self.tp_size, self.ep_size, self.device = tp_size, ep_size, torch.device(device)
        self.ranks = Ranks(group)  # gloo group of this engine's ranks (None when tp_size == 1)
        self.model = self._load(model_path, dtype, dummy, seed).eval().requires_grad_(False)
        params = dict(self.model.named_parameters(remove_duplicate=False))
        self.dtype = next(iter(params.values())).dtype
        self.schema = WeightSchema.of(self.model, params)
        _own_storages(params)
        self._storages = _unique_storages(params)  # (storage, bytes when resident)
        self.load_prints = LoadPrints(self.schema.plain_to_param, self.schema.checkpoint_shapes)
        self.lora = LoraMerge(self.model, params, lora, self.ranks, on_merge=self.load_prints.forget)
        groups = WeightGroups(self.ranks, tp_size, self.device)
        self.weights = WeightUpdater(
            self.model,
            self.schema,
            self.lora,
            self.ranks,
            self.load_prints,
            groups,
            released=self.weights_released,
            loaded=not dummy,
        )
        self.remote = RemoteInstance(self.model, self.lora, self.weights, self.load_prints, self.ranks)
        self.cache: DynamicCache | None = None
        self._weight_backup: list[torch.UntypedStorage] | None = None  # released weights' host copy

    @property
    def weights_ready(self) -> bool:
        return self.weights.ready

    def weights_released(self) -> bool:
        return any(storage.nbytes() == 0 for storage, _ in self._storages)

    def _refuse_if_released(self) -> None:
        """Reads of released weights would touch freed memory (a SIGSEGV on CPU): refuse them. Every
        rank released in lockstep, so every rank refuses alike, before any collective."""
        if self.weights_released():
            raise WeightUpdateError(
                f"weights are released: call /resume_memory_occupation with tags {[WEIGHT_TAG]} first"
            )

    # ---- loading -------------------------------------------------------------------------
    def _distributed_config(self) -> DistributedConfig | None:
        if self.tp_size == 1:
            return None
        if self.ep_size > 1:
            return DistributedConfig(tp_size=self.tp_size, ep_size=self.ep_size)
        return DistributedConfig(tp_size=self.tp_size, tp_plan="auto")

    def _load(self, model_path: str, dtype: torch.dtype, dummy: bool, seed: int):
        if not dummy:
            return self._from_pretrained(model_path, dtype)
        # Random weights (`--load-format dummy`): write one random checkpoint and let transformers'
        # own loader shard it, so every rank holds exactly the layout a real load gives it.
        group, rank = self.ranks.group, self.ranks.rank
        scratch = [tempfile.mkdtemp(prefix="rollfleet-dummy-")] if rank == 0 else [None]
        if rank == 0:
            torch.manual_seed(seed)
            config = AutoConfig.from_pretrained(model_path)
            AutoModelForCausalLM.from_config(config, dtype=dtype).save_pretrained(scratch[0])
        if group is not None:
            dist.broadcast_object_list(scratch, src=dist.get_global_rank(group, 0), group=group)
        try:
            return self._from_pretrained(scratch[0], dtype)
        finally:
            if group is not None:
                dist.barrier(group=group)
            if rank == 0:
                shutil.rmtree(scratch[0], ignore_errors=True)

    def _from_pretrained(self, path: str, dtype: torch.dtype):
        distributed = self._distributed_config()
        if distributed is None:
            return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, disable_mmap=True).to(self.device)
        return AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, distributed_config=distributed, disable_mmap=True
        )

    # ---- generation (lockstep) ----------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, prompts: list[list[int]], lora_name: str | None = None, keep: int = 1) -> torch.Tensor:
        """Start a batch: left-pad the prompts, fill a fresh KV cache, return last-position logits
        ([batch, vocab]; with keep > 1 the last `keep` positions', [batch, keep, vocab], for input
        logprobs). The whole batch runs with one LoRA adapter, or none."""
        self.lora.use(lora_name)
        width = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        self.mask = torch.zeros(len(prompts), width, dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            self.mask[row, width - len(prompt) :] = 1
        positions = (self.mask.cumsum(-1) - 1).clamp(min=0)
        self.next_position = positions[:, -1] + 1
        self.cache = DynamicCache(config=self.model.config)
        return self._forward(ids, positions, keep)

    @torch.inference_mode()
    def decode(self, tokens: list[int], lora_name: str | None = None) -> torch.Tensor:
        self.lora.use(lora_name)  # merged again if a read or update restored the base mid-batch
        self.mask = torch.cat([self.mask, torch.ones(len(tokens), 1, dtype=torch.long)], dim=1)
        logits = self._forward(torch.tensor(tokens)[:, None], self.next_position[:, None])
        self.next_position = self.next_position + 1
        return logits

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, keep: int = 1) -> torch.Tensor:
        out = self.model(
            input_ids=ids.to(self.device),
            attention_mask=self.mask.to(self.device),
            position_ids=positions.to(self.device),
            cache=self.cache,
            use_cache=True,
            logits_to_keep=keep,
        )
        logits = out.logits[:, -keep:, :].float().cpu()
        return logits[:, -1, :] if keep == 1 else logits

    def keep_rows(self, rows: list[int]) -> None:
        """Drop finished sequences from the running batch."""
        index = torch.tensor(rows, dtype=torch.long)
        self.cache.batch_select_indices(index.to(self.device))
        self.mask, self.next_position = self.mask[index], self.next_position[index]

    def end_batch(self) -> None:
        self.cache = None

    # ---- weight reads (lockstep) ----------------------------------------------------------
    def get_weights_by_name(self, name: str, truncate_size: int) -> list[float]:
        """First values of a parameter, by checkpoint name (per expert for MoE) or in-memory name."""
        self._refuse_if_released()
        params = self.lora.base_params()
        if name in params:
            full = full_of(params[name])
        elif name in self.schema.checkpoint_to_param:
            param_name = self.schema.checkpoint_to_param[name]
            full = model_to_checkpoint(self.model, {param_name: full_of(params[param_name])})[name]
        else:
            raise WeightUpdateError(f"name={name!r} is not a parameter of this model")
        return full[:truncate_size].float().tolist()  # SGLang's `param[:truncate_size]`: the first rows

    def shard_fingerprints(self) -> list[dict[str, str]]:
        """Per rank: in-memory parameter name -> sha256 of this rank's local shard bytes."""
        self._refuse_if_released()
        params = self.lora.base_params()
        return self.ranks.gather({name: tensor_sha256(local_of(p)) for name, p in params.items()})

    def weights_fingerprint(self, names: list[str] | None, samples: int) -> dict[str, str]:
        """Checkpoint name -> fingerprint of the full tensor (rollfleet.wire.fingerprint), for the
        given names (all when None); the sender computes the same over what it sent."""
        self._refuse_if_released()
        params, schema = self.lora.base_params(), self.schema
        wanted = set(schema.checkpoint_to_param) if names is None else set(names)
        unknown = sorted(wanted - set(schema.checkpoint_to_param))
        if unknown:
            raise WeightUpdateError(f"names not in this model: {unknown[:10]}")
        start = time.perf_counter()
        taken = self.load_prints.digests()
        known = {} if samples != self.load_prints.samples else {n: taken[n] for n in wanted if n in taken}
        wanted -= set(known)
        # parameters stay alive anyway: gather their samples once, not every HOLD_BYTES
        collector = Fingerprints(samples=samples, hold_bytes=math.inf)
        for name in sorted(n for n in wanted if n in schema.plain_to_param):
            collector.add(name, full_of(params[schema.plain_to_param[name]]))  # collective on DTensors
        fused = {schema.checkpoint_to_param[n] for n in wanted if n not in schema.plain_to_param}
        for param_name in sorted(fused):
            full = full_of(params[param_name])  # collective on DTensors: every rank runs this loop
            for name, tensor in model_to_checkpoint(self.model, {param_name: full}).items():
                if name in wanted:
                    collector.add(name, tensor)
        digests = {**known, **collector.digests()}
        if SYNC_TIMING:
            log.warning(
                "fingerprints of %d tensors (%d taken at load): %.2fms",
                len(digests),
                len(known),
                (time.perf_counter() - start) * 1e3,
            )
        return digests

    # ---- memory (lockstep) ----------------------------------------------------------------
    def memory(self) -> list[dict[str, int]]:
        """Per rank: weight bytes and, on GPU, allocated / reserved / peak allocated / device used."""
        stats = self._memory()
        if self.device.type == "cuda":
            stats["peak_allocated"] = torch.cuda.max_memory_allocated(self.device)
        return self.ranks.gather(stats)

    def release_memory(self, tags: list[str], cpu_backup: bool = False) -> list[dict[str, int]]:
        """Free the tagged memory; with `cpu_backup` (SGLang's --enable-weights-cpu-backup) complete
        weights are copied to the host first and come back on resume, ready to serve."""
        params = self.lora.base_params()  # no adapter's saved base values outlive the weights
        before = self._memory()
        self.weights.drop_held_payloads()
        if WEIGHT_TAG in tags:
            if not self.weights_released():  # a second release keeps the first one's copy
                self._weight_backup = _host_copies(self._storages) if cpu_backup and self.weights.ready else None
            for storage, _ in _unique_storages(params):
                storage.resize_(0)
            self.weights.forget_loaded()
            self.load_prints.forget()
        if KV_CACHE_TAG in tags:
            self.cache = None
        self._empty_cache()
        return self.ranks.gather({"before": before, "after": self._memory()})

    def resume_memory(self, tags: list[str]) -> list[dict[str, int]]:
        before = self._memory()
        if WEIGHT_TAG in tags:
            for storage, nbytes in self._storages:
                if storage.nbytes() == 0:
                    storage.resize_(nbytes)
            backup, self._weight_backup = self._weight_backup, None
            if backup is not None:
                for (storage, _), copy in zip(self._storages, backup):
                    storage.copy_(copy)
                self.weights.mark_loaded()
        return self.ranks.gather({"before": before, "after": self._memory()})

    def update_weights_from_disk(self, model_path: str) -> list[str]:
        """A disk update loads every tensor, so SGLang-style clients send it whatever the memory state
        (AReaL's colocated cycle sends it while weights are released): released weights are
        allocated again first, and released again if the update is refused (nothing changed)."""
        was_released = self.weights_released()
        if was_released:
            self.resume_memory([WEIGHT_TAG])
        try:
            return self.weights.from_disk(model_path)
        except WeightUpdateError:
            if was_released:
                self.release_memory([WEIGHT_TAG])
            raise

    def _memory(self) -> dict[str, int]:
        weight_bytes = sum(storage.nbytes() for storage, _ in self._storages)
        stats = {"weight_bytes": weight_bytes}
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            stats.update(
                allocated=torch.cuda.memory_allocated(self.device),
                reserved=torch.cuda.memory_reserved(self.device),
                device_used=total - free,
            )
        return stats

    def _empty_cache(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()


@torch.no_grad()
def _own_storages(params: dict[str, torch.Tensor]) -> None:
    """Give every parameter a storage of its own: loaded tensors may alias a file buffer, which
    cannot be resized, and release/resume frees and re-allocates storages in place."""
    for param in {id(p): p for p in params.values()}.values():
        local = local_of(param)
        if not local.untyped_storage().resizable():
            local.set_(local.clone())


def _host_copies(storages: list[tuple[torch.UntypedStorage, int]]) -> list[torch.UntypedStorage]:
    """A host copy of each storage (a new one also on the CPU, where `.cpu()` would alias it)."""
    return [torch.UntypedStorage(storage.nbytes(), device="cpu").copy_(storage) for storage, _ in storages]


def _unique_storages(params: dict[str, torch.Tensor]) -> list[tuple[torch.UntypedStorage, int]]:
    seen: dict[int, tuple[torch.UntypedStorage, int]] = {}
    for param in params.values():
        storage = local_of(param).untyped_storage()
        seen.setdefault(storage.data_ptr(), (storage, storage.nbytes()))
    return list(seen.values())


def local_device(device_type: str, base_gpu_id: int, tp_rank: int) -> str:
    """The device of one tp rank: GPU base_gpu_id + tp_rank, or the CPU."""
    if device_type == "cpu":
        return "cpu"
    os.environ["LOCAL_RANK"] = str(base_gpu_id + tp_rank)  # transformers binds its TP device from this
    torch.cuda.set_device(base_gpu_id + tp_rank)
    return f"cuda:{base_gpu_id + tp_rank}"
