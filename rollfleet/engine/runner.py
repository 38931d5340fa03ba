"""The model inside one tensor-parallel rank of the embedded engine.

Every public method is a *lockstep action*: tp rank 0 decides, broadcasts the action with its
arguments, and every rank runs the same method in the same order (see server.py). Methods that
use collectives (weight updates, full tensors, fingerprints) rely on that.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor, distribute_tensor
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache
from transformers.distributed import DistributedConfig

from rollfleet.weights.naming import checkpoint_to_model, model_to_checkpoint

WEIGHT_TAG, KV_CACHE_TAG = "weights", "kv_cache"


class WeightUpdateError(ValueError):
    """A weight update was refused before any parameter changed."""


def read_hf_checkpoint(path: str) -> dict[str, torch.Tensor]:
    """All tensors of a HF model directory's safetensors files, or WeightUpdateError naming the problem."""
    directory = Path(path)
    if not directory.is_dir():
        raise WeightUpdateError(f"model_path={path!r} is not a directory: give a HF model directory")
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise WeightUpdateError(f"model_path={path!r} holds no *.safetensors file: save the model with "
                                "save_pretrained(safe_serialization=True)")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            tensors.update(load_file(file))
        except (SafetensorError, OSError) as exc:
            raise WeightUpdateError(f"cannot read {file.name} in {path!r}: {exc}") from exc
    return tensors


def _local(param: torch.Tensor) -> torch.Tensor:
    """The tensor object holding this rank's values (`to_local()` may return a fresh alias)."""
    return param._local_tensor if isinstance(param, DTensor) else param


def tensor_sha256(tensor: torch.Tensor) -> str:
    # a copy: numpy() on the parameter itself would pin its storage (no release/resume afterwards)
    data = tensor.detach().to("cpu", copy=True).contiguous().view(-1).view(torch.uint8)
    return hashlib.sha256(data.numpy()).hexdigest()


def _full(param: torch.Tensor) -> torch.Tensor:
    return param.full_tensor() if isinstance(param, DTensor) else param.data


class ModelRunner:
    def __init__(self, model_path: str, *, tp_size: int = 1, ep_size: int = 1, device: str = "cpu",
                 dtype: torch.dtype = torch.float32, dummy: bool = False, group=None, seed: int = 0):
        self.tp_size, self.ep_size, self.device = tp_size, ep_size, torch.device(device)
        self.group = group  # gloo group of this engine's ranks (None when tp_size == 1)
        self.model = self._load(model_path, dtype, dummy, seed).eval().requires_grad_(False)
        self.params = dict(self.model.named_parameters(remove_duplicate=False))
        self._build_checkpoint_schema()
        self.loaded_names: set[str] = set() if dummy else set(self.required_names)
        self._own_storages()
        self._storages = self._unique_storages()
        self.cache: DynamicCache | None = None

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
        rank = dist.get_rank(self.group) if self.group is not None else 0
        scratch = [tempfile.mkdtemp(prefix="rollfleet-dummy-")] if rank == 0 else [None]
        if rank == 0:
            torch.manual_seed(seed)
            config = AutoConfig.from_pretrained(model_path)
            AutoModelForCausalLM.from_config(config, dtype=dtype).save_pretrained(scratch[0])
        if self.group is not None:
            dist.broadcast_object_list(scratch, src=dist.get_global_rank(self.group, 0), group=self.group)
        try:
            return self._from_pretrained(scratch[0], dtype)
        finally:
            if self.group is not None:
                dist.barrier(group=self.group)
            if rank == 0:
                shutil.rmtree(scratch[0], ignore_errors=True)

    def _from_pretrained(self, path: str, dtype: torch.dtype):
        distributed = self._distributed_config()
        if distributed is None:
            return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, disable_mmap=True).to(self.device)
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, distributed_config=distributed,
                                                    disable_mmap=True)

    def _build_checkpoint_schema(self) -> None:
        """Checkpoint name -> (in-memory parameter, full shape), computed on meta tensors."""
        self.checkpoint_shapes: dict[str, tuple[int, ...]] = {}
        self.checkpoint_to_param: dict[str, str] = {}
        unique = {id(p): name for name, p in self.model.named_parameters()}
        self.required_names: set[str] = set()
        for name, param in self.params.items():
            meta = {name: torch.empty(param.shape, dtype=param.dtype, device="meta")}
            for ckpt_name, tensor in model_to_checkpoint(self.model, meta).items():
                self.checkpoint_shapes[ckpt_name] = tuple(tensor.shape)
                self.checkpoint_to_param[ckpt_name] = name
                if unique.get(id(param)) == name:
                    self.required_names.add(ckpt_name)

    @torch.no_grad()
    def _own_storages(self) -> None:
        """Give every parameter a storage of its own: loaded tensors may alias a file buffer, which
        cannot be resized, and release/resume frees and re-allocates storages in place."""
        for param in {id(p): p for p in self.params.values()}.values():
            local = _local(param)
            if not local.untyped_storage().resizable():
                local.set_(local.clone())

    def _unique_storages(self) -> list[tuple[torch.UntypedStorage, int]]:
        seen: dict[int, tuple[torch.UntypedStorage, int]] = {}
        for param in self.params.values():
            storage = _local(param).untyped_storage()
            seen.setdefault(storage.data_ptr(), (storage, storage.nbytes()))
        return list(seen.values())

    @property
    def weights_ready(self) -> bool:
        return self.required_names <= self.loaded_names

    # ---- generation (lockstep) ----------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, prompts: list[list[int]]) -> torch.Tensor:
        """Start a batch: left-pad the prompts, fill a fresh KV cache, return last-position logits."""
        width = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        self.mask = torch.zeros(len(prompts), width, dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt):] = torch.tensor(prompt)
            self.mask[row, width - len(prompt):] = 1
        positions = (self.mask.cumsum(-1) - 1).clamp(min=0)
        self.next_position = positions[:, -1] + 1
        self.cache = DynamicCache(config=self.model.config)
        return self._forward(ids, positions)

    @torch.inference_mode()
    def decode(self, tokens: list[int]) -> torch.Tensor:
        self.mask = torch.cat([self.mask, torch.ones(len(tokens), 1, dtype=torch.long)], dim=1)
        logits = self._forward(torch.tensor(tokens)[:, None], self.next_position[:, None])
        self.next_position = self.next_position + 1
        return logits

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        out = self.model(input_ids=ids.to(self.device), attention_mask=self.mask.to(self.device),
                         position_ids=positions.to(self.device), cache=self.cache,
                         use_cache=True, logits_to_keep=1)
        return out.logits[:, -1, :].float().cpu()

    def keep_rows(self, rows: list[int]) -> None:
        """Drop finished sequences from the running batch."""
        index = torch.tensor(rows, dtype=torch.long)
        self.cache.batch_select_indices(index.to(self.device))
        self.mask, self.next_position = self.mask[index], self.next_position[index]

    def end_batch(self) -> None:
        self.cache = None

    # ---- weights (lockstep; all or nothing across ranks) --------------------------------
    def update_weights_from_disk(self, model_path: str) -> None:
        def read():
            return read_hf_checkpoint(model_path), True
        self._update(read)

    def update_weights(self, tensors: dict[str, torch.Tensor], complete: bool = False) -> None:
        self._update(lambda: (tensors, complete))

    def _update(self, produce) -> None:
        try:
            tensors, complete = produce()
            staged, error = self._stage(tensors, complete), None
        except WeightUpdateError as exc:
            staged, error = None, str(exc)
        errors = self._gather(error)
        if any(errors):
            raise WeightUpdateError("; ".join(sorted({e for e in errors if e})))
        with torch.no_grad():
            for target, value in staged:
                target.copy_(value)
        self.loaded_names |= set(tensors)

    def _stage(self, tensors: dict[str, torch.Tensor], complete: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Check every name, shape and dtype, then build each local shard; no parameter changes here."""
        if any(storage.nbytes() == 0 for storage, _ in self._storages):
            raise WeightUpdateError("weights are released: call /resume_memory_occupation with tags "
                                    "['weights'] before pushing weights")
        unknown = sorted(set(tensors) - set(self.checkpoint_shapes))
        shapes = sorted(f"{n}: got {tuple(t.shape)}, expected {self.checkpoint_shapes[n]}"
                        for n, t in tensors.items() if n in self.checkpoint_shapes
                        and tuple(t.shape) != self.checkpoint_shapes[n])
        dtypes = sorted(f"{n}: {t.dtype}" for n, t in tensors.items() if not t.is_floating_point())
        missing = sorted(self.required_names - set(tensors)) if complete else []
        problems = [f"{label} ({len(names)}): {', '.join(names[:10])}{' ...' if len(names) > 10 else ''}"
                    for label, names in [("unknown tensor names", unknown), ("wrong shapes", shapes),
                                         ("non-floating dtypes", dtypes), ("missing tensors", missing)] if names]
        if problems:
            raise WeightUpdateError("weight update refused, nothing changed: " + "; ".join(problems))
        try:
            converted = checkpoint_to_model(self.model, tensors)
        except ValueError as exc:
            raise WeightUpdateError(f"weight update refused, nothing changed: {exc}") from exc
        staged = []
        for name, full in converted.items():
            param = self.params.get(name)
            if param is None or tuple(full.shape) != tuple(param.shape):
                expected = None if param is None else tuple(param.shape)
                raise WeightUpdateError(f"weight update refused, nothing changed: {name} built with shape "
                                        f"{tuple(full.shape)}, the model holds {expected} (incomplete expert group?)")
            full = full.to(device=_local(param).device, dtype=param.dtype)
            if isinstance(param, DTensor):
                full = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
            staged.append((_local(param), full))
        return staged

    def _gather(self, value):
        if self.group is None:
            return [value]
        out = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(out, value, group=self.group)
        return out

    def get_weights_by_name(self, name: str, truncate_size: int) -> list[float]:
        """First values of a parameter, by checkpoint name (per expert for MoE) or in-memory name."""
        if name in self.params:
            full = _full(self.params[name])
        elif name in self.checkpoint_to_param:
            param_name = self.checkpoint_to_param[name]
            full = model_to_checkpoint(self.model, {param_name: _full(self.params[param_name])})[name]
        else:
            raise WeightUpdateError(f"name={name!r} is not a parameter of this model")
        return full.flatten()[:truncate_size].float().tolist()

    def shard_fingerprints(self) -> list[dict[str, str]]:
        """Per rank: in-memory parameter name -> sha256 of this rank's local shard bytes."""
        mine = {name: tensor_sha256(_local(p)) for name, p in self.params.items()}
        return self._gather(mine)

    # ---- memory (lockstep) ----------------------------------------------------------------
    def release_memory(self, tags: list[str]) -> list[dict[str, int]]:
        before = self._memory()
        if WEIGHT_TAG in tags:
            for storage, _ in self._storages:
                storage.resize_(0)
            self.loaded_names = set()  # SGLang semantics: released weights must be pushed again
        if KV_CACHE_TAG in tags:
            self.cache = None
        self._empty_cache()
        return self._gather({"before": before, "after": self._memory()})

    def resume_memory(self, tags: list[str]) -> list[dict[str, int]]:
        before = self._memory()
        if WEIGHT_TAG in tags:
            for storage, nbytes in self._storages:
                if storage.nbytes() == 0:
                    storage.resize_(nbytes)
        return self._gather({"before": before, "after": self._memory()})

    def _memory(self) -> dict[str, int]:
        weight_bytes = sum(storage.nbytes() for storage, _ in self._storages)
        stats = {"weight_bytes": weight_bytes}
        if self.device.type == "cuda":
            stats.update(allocated=torch.cuda.memory_allocated(self.device),
                         reserved=torch.cuda.memory_reserved(self.device),
                         device_used=torch.cuda.mem_get_info(self.device)[1] - torch.cuda.mem_get_info(self.device)[0])
        return stats

    def _empty_cache(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()


def local_device(device_type: str, base_gpu_id: int, tp_rank: int) -> str:
    """The device of one tp rank: GPU base_gpu_id + tp_rank, or the CPU."""
    if device_type == "cpu":
        return "cpu"
    os.environ["LOCAL_RANK"] = str(base_gpu_id + tp_rank)  # transformers binds its TP device from this
    torch.cuda.set_device(base_gpu_id + tp_rank)
    return f"cuda:{base_gpu_id + tp_rank}"
