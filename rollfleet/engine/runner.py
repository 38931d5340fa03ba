"""The model inside one tensor-parallel rank of the embedded engine.

Every public method is a *lockstep action*: tp rank 0 decides, broadcasts the action with its
arguments, and every rank runs the same method in the same order (see server.py). Methods that
use collectives (weight updates, full tensors, fingerprints) rely on that.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import os
import shutil
import tempfile
import time
from collections import Counter, deque
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache
from transformers.distributed import DistributedConfig

from rollfleet.engine.lora import (
    TENSORS_PATH,
    LoraAdapter,
    LoraError,
    LoraLimits,
    linear_targets,
    parse_adapter,
    read_adapter_dir,
)
from rollfleet.wire.buckets import Bucket, dtype_from_name, view_bytes_as
from rollfleet.wire.fingerprint import Fingerprints, sample_view
from rollfleet.wire.group import join_weight_update_group
from rollfleet.wire.hf_files import CheckpointReadError, read_checkpoint
from rollfleet.wire.naming import checkpoint_to_model, model_to_checkpoint, plain_names
from rollfleet.wire.serialize import safe_loads

log = logging.getLogger("rollfleet.engine")
WEIGHT_TAG, KV_CACHE_TAG = "weights", "kv_cache"
WEIGHT_GROUP_BACKENDS = ("nccl", "gloo")
SYNC_TIMING = os.environ.get("ROLLFLEET_SYNC_TIMING") == "1"  # log each weight update's phases (CPU time)


class WeightUpdateError(ValueError):
    """A weight update was refused before any parameter changed."""


def _local(param: torch.Tensor) -> torch.Tensor:
    """The tensor object holding this rank's values (`to_local()` may return a fresh alias)."""
    return param._local_tensor if isinstance(param, DTensor) else param


def tensor_sha256(tensor: torch.Tensor) -> str:
    # a copy: numpy() on the parameter itself would pin its storage (no release/resume afterwards)
    data = tensor.detach().to("cpu", copy=True).contiguous().view(-1).view(torch.uint8)
    return hashlib.sha256(data.numpy()).hexdigest()


def _full(param: torch.Tensor) -> torch.Tensor:
    return param.full_tensor() if isinstance(param, DTensor) else param.data


@dataclass
class WeightGroup:
    """A joined weight-update group: broadcasts from its rank 0 arrive on `device`."""

    group: dist.ProcessGroup
    rank: int
    world_size: int
    device: torch.device
    # GPU receives run on a stream of their own: a broadcast launched from the default stream would
    # wait for the previous call's copy into the parameters, leaving the wire idle during each copy
    stream: torch.cuda.Stream | None = None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _named_tensors(payload: Any, load_format: str | None) -> dict[str, torch.Tensor]:
    """One rank's decoded `/update_weights_from_tensor` payload -> checkpoint name -> full tensor.

    null / "direct": a list of (name, tensor) pairs. "flattened_bucket": one bucket payload
    `{"flattened_tensor", "metadata"}` or a list of them.
    """
    if load_format == "flattened_bucket":
        payloads = payload if isinstance(payload, (list, tuple)) else [payload]
        try:
            pairs = [pair for item in payloads for pair in Bucket.from_payload(item).unpack().items()]
        except ValueError as exc:
            raise WeightUpdateError(f"weight update refused, nothing changed: {exc}") from exc
    else:
        if not isinstance(payload, (list, tuple)) or not all(
            isinstance(p, (list, tuple)) and len(p) == 2 and isinstance(p[0], str) for p in payload
        ):
            raise WeightUpdateError(
                f"load_format={load_format!r} expects a list of (name, tensor) pairs, got "
                f"{type(payload).__name__}; bucket payloads need load_format='flattened_bucket'"
            )
        pairs = list(payload)
    not_tensors = sorted(name for name, tensor in pairs if not isinstance(tensor, torch.Tensor))
    if not_tensors:
        raise WeightUpdateError(f"weight update refused, nothing changed: not tensors: {', '.join(not_tensors[:10])}")
    tensors = dict(pairs)
    if len(tensors) != len(pairs):
        twice = sorted(name for name, count in Counter(name for name, _ in pairs).items() if count > 1)
        raise WeightUpdateError(f"weight update refused, nothing changed: names sent twice: {', '.join(twice[:10])}")
    return tensors


def _parse_specs(names: list[str], dtypes: list[str], shapes: list[list[int]]) -> list[tuple[str, torch.dtype, tuple]]:
    """(name, dtype, shape) per tensor of a distributed update; WeightUpdateError when the metadata
    cannot say how many bytes the sender broadcasts."""
    if not len(names) == len(dtypes) == len(shapes):
        raise WeightUpdateError(
            f"names ({len(names)}), dtypes ({len(dtypes)}) and shapes ({len(shapes)}) must have "
            "the same length; nothing was received, so the sender's broadcast is left waiting "
            "until the group times out: destroy the group and init a new one"
        )
    specs = []
    for name, dtype, shape in zip(names, dtypes, shapes):
        try:
            dtype = dtype_from_name(dtype)
        except ValueError as exc:
            raise WeightUpdateError(
                f"{name}: {exc}; nothing was received, so the sender's broadcast is left "
                "waiting until the group times out: destroy the group and init a new one"
            ) from exc
        if any(d < 0 for d in shape):
            raise WeightUpdateError(
                f"{name}: shape {shape} has a negative size; nothing was received, so the sender's "
                "broadcast is left waiting until the group times out"
            )
        specs.append((name, dtype, tuple(shape)))
    return specs


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
        self.group = group  # gloo group of this engine's ranks (None when tp_size == 1)
        self.model = self._load(model_path, dtype, dummy, seed).eval().requires_grad_(False)
        self.params = dict(self.model.named_parameters(remove_duplicate=False))
        self._build_checkpoint_schema()
        self.loaded_names: set[str] = set() if dummy else set(self.required_names)
        self._own_storages()
        self._storages = self._unique_storages()
        self.lora_limits = lora  # None: LoRA is off (no --enable-lora)
        self.lora_targetable = linear_targets(self.model, self.params)
        self.lora_adapters: dict[str, LoraAdapter] = {}
        self.active_lora: str | None = None  # the adapter merged into the weights now
        self._lora_base: list[tuple[torch.Tensor, torch.Tensor]] = []  # (local weight, its saved base values)
        self.cache: DynamicCache | None = None
        self.weight_groups: dict[str, WeightGroup] = {}
        # The last two decoded tensor payloads stay referenced until the sync ends: a sender
        # alternates two buffers, and a buffer still referenced here is not mapped again (opening a
        # CUDA IPC handle costs far more than reading a few hundred MB).
        self._held_payloads: deque = deque(maxlen=2)
        # Fingerprints of parameters sampled right after an update copied into them (gathered on the
        # device; copied to the host and hashed when asked), so verification samples no tensor again.
        # Only parameters that are their checkpoint tensor and unsharded (tp=1, not fused experts);
        # anything else that changes weights (a LoRA merge, release) drops them all.
        self._sample_views: dict[str, torch.Tensor | None] = {}
        self._forget_load_prints()

    @property
    def tp_rank(self) -> int:
        return dist.get_rank(self.group) if self.group is not None else 0

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
        return AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, distributed_config=distributed, disable_mmap=True
        )

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
        # checkpoint name -> parameter name where the checkpoint tensor IS the parameter: loads and
        # fingerprints of these skip transformers' conversion (computed once, here)
        self.plain_to_param = {ckpt: name for name, ckpt in plain_names(self.model).items()}

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
    def prefill(self, prompts: list[list[int]], lora_name: str | None = None) -> torch.Tensor:
        """Start a batch: left-pad the prompts, fill a fresh KV cache, return last-position logits.
        The whole batch runs with one LoRA adapter, or none."""
        self._use_lora(lora_name)
        width = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        self.mask = torch.zeros(len(prompts), width, dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            self.mask[row, width - len(prompt) :] = 1
        positions = (self.mask.cumsum(-1) - 1).clamp(min=0)
        self.next_position = positions[:, -1] + 1
        self.cache = DynamicCache(config=self.model.config)
        return self._forward(ids, positions)

    @torch.inference_mode()
    def decode(self, tokens: list[int], lora_name: str | None = None) -> torch.Tensor:
        self._use_lora(lora_name)  # merged again if a read or update restored the base mid-batch
        self.mask = torch.cat([self.mask, torch.ones(len(tokens), 1, dtype=torch.long)], dim=1)
        logits = self._forward(torch.tensor(tokens)[:, None], self.next_position[:, None])
        self.next_position = self.next_position + 1
        return logits

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        out = self.model(
            input_ids=ids.to(self.device),
            attention_mask=self.mask.to(self.device),
            position_ids=positions.to(self.device),
            cache=self.cache,
            use_cache=True,
            logits_to_keep=1,
        )
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
        self._restore_base_weights()

        def read():
            try:
                return read_checkpoint(model_path), True
            except CheckpointReadError as exc:
                raise WeightUpdateError(str(exc)) from exc

        self._update(read)

    def update_weights_from_tensor(self, serialized_named_tensors: list[str], load_format: str | None = None) -> None:
        """Every rank decodes its own entry, `serialized_named_tensors[tp_rank]` (SGLang's rule)."""
        self._restore_base_weights()

        def decode():
            entry = serialized_named_tensors[self.tp_rank]
            try:
                payload = safe_loads(entry)
                self._held_payloads.append(payload)
            except Exception as exc:  # untrusted bytes: every failure to rebuild them is the sender's, reported
                raise WeightUpdateError(
                    f"serialized_named_tensors[{self.tp_rank}] cannot be read: {type(exc).__name__}: {_first_line(exc)}"
                ) from exc
            return _named_tensors(payload, load_format), False

        self._update(decode)
        # The sender's buffers are read here through CUDA IPC / shared memory: finish reading them
        # before answering, since the sender reuses or frees them once every engine has answered.
        self._synchronize()

    def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str,
        load_format: str | None = None,
    ) -> None:
        """Receive full tensors broadcast by rank 0 of a weight-update group, then load them all or nothing.

        Wire contract (SGLang's, python/sglang/srt/model_executor/model_runner.py):
          - load_format None: one broadcast per tensor, in `names` order, each a tensor of exactly
            `shapes[i]` and `dtypes[i]`.
          - load_format "flattened_bucket": ONE broadcast for the whole call: a 1-D uint8 tensor of
            sum(numel_i * itemsize_i) bytes holding each tensor's bytes back to back, in `names`
            order, no padding (current SGLang's FlattenedTensorBucket, `supports_multi_dtypes`). A
            rollfleet bucket is one dtype, so its sender broadcasts
            `bucket.flattened_tensor.view(torch.uint8)` with one call per bucket; byte for byte this
            is also the element-typed bucket older SGLang broadcast.
        Names, shapes and dtypes are checked against the model BEFORE receiving. A refused update
        still receives (and drops) every broadcast the metadata announces, so the sender's
        broadcasts complete and the group stays usable; then every rank refuses and nothing
        changes. Only a request that cannot say what the sender broadcasts (lists of different
        lengths, an unknown dtype name, a negative size, a group this engine has not joined) is
        refused without receiving: the sender then waits until its group's timeout, and the group
        must be destroyed and made again.
        """
        self._restore_base_weights()

        def receive():
            group = self.weight_groups.get(group_name)
            if group is None:
                raise WeightUpdateError(
                    f"no weight update group {group_name!r} on this engine (have "
                    f"{sorted(self.weight_groups)}): call /init_weights_update_group first"
                )
            specs = _parse_specs(names, dtypes, shapes)
            if load_format == "flattened_bucket" and not specs:
                raise WeightUpdateError("load_format='flattened_bucket' with no tensors: nothing was received")
            try:
                self._check(
                    {name: torch.empty(shape, dtype=dtype, device="meta") for name, dtype, shape in specs},
                    complete=False,
                )
                duplicates = sorted(name for name, count in Counter(names).items() if count > 1)
                if duplicates:
                    raise WeightUpdateError(
                        f"weight update refused, nothing changed: names sent twice: {', '.join(duplicates[:10])}"
                    )
                refusal = None
            except WeightUpdateError as exc:
                refusal = exc
            tensors = self._receive(group, group_name, specs, load_format)
            if refusal is not None:
                raise WeightUpdateError(f"{refusal} (the broadcast was received and dropped)")
            return tensors, False

        self._update(receive)

    def _receive(self, group: WeightGroup, group_name: str, specs, load_format: str | None) -> dict[str, torch.Tensor]:
        try:
            if load_format == "flattened_bucket":
                sizes = [math.prod(shape) * dtype.itemsize for _, dtype, shape in specs]
                with torch.cuda.stream(group.stream) if group.stream is not None else contextlib.nullcontext():
                    flat = torch.empty(sum(sizes), dtype=torch.uint8, device=group.device)
                    dist.broadcast(flat, group=group.group, group_src=0)
                if group.stream is not None:  # the copies (default stream) start once the bytes landed
                    torch.cuda.current_stream(group.device).wait_stream(group.stream)
                    flat.record_stream(torch.cuda.current_stream(group.device))  # freed only after they read it
                if len({dtype for _, dtype, _ in specs}) == 1:  # the usual call: one split, no per-tensor slicing
                    pieces = flat.view(specs[0][1]).split([math.prod(shape) for _, _, shape in specs])
                    return {name: piece.view(shape) for (name, _, shape), piece in zip(specs, pieces)}
                tensors, offset = {}, 0
                for (name, dtype, shape), size in zip(specs, sizes):
                    tensors[name] = view_bytes_as(flat[offset : offset + size], dtype).view(shape)
                    offset += size
                return tensors
            tensors = {}
            for name, dtype, shape in specs:
                tensors[name] = torch.empty(shape, dtype=dtype, device=group.device)
                dist.broadcast(tensors[name], group=group.group, group_src=0)
            return tensors
        except RuntimeError as exc:  # a broadcast that timed out or lost a peer (DistBackendError)
            raise WeightUpdateError(
                f"receiving from weight update group {group_name!r} failed, nothing changed: "
                f"{_first_line(exc)}; the group may be unusable now: destroy it and init a new "
                "one"
            ) from exc

    def _update(self, produce) -> None:
        clock = [time.perf_counter()]
        try:
            tensors, complete = produce()
            clock.append(time.perf_counter())
            staged, error = self._stage(tensors, complete), None
        except WeightUpdateError as exc:
            staged, error = None, str(exc)
        clock.append(time.perf_counter())
        errors = self._gather(error)
        if any(errors):
            raise WeightUpdateError("; ".join(sorted({e for e in errors if e})))
        clock.append(time.perf_counter())
        with torch.no_grad():
            same_device = [(t, v) for t, v in staged if t.device == v.device and t.dtype == v.dtype]
            if same_device:  # one multi-tensor copy instead of a kernel launch per tensor
                torch._foreach_copy_([t for t, _ in same_device], [v for _, v in same_device])
            for target, value in staged:
                if target.device != value.device or target.dtype != value.dtype:
                    target.copy_(value)
        self.loaded_names |= set(tensors)
        self._take_load_prints(tensors)
        if SYNC_TIMING:
            clock.append(time.perf_counter())
            phases = zip(("receive", "stage", "gather", "copy"), (b - a for a, b in zip(clock, clock[1:])))
            log.warning(
                "weight update of %d tensors: %s",
                len(tensors),
                " ".join(f"{name}={seconds * 1e3:.2f}ms" for name, seconds in phases),
            )

    def _take_load_prints(self, names) -> None:
        for name in names:
            sample = self._load_sample(name)
            if sample is not None:
                self._load_prints.add_sample(name, self.checkpoint_shapes[name], sample)
            else:
                self._load_digests.pop(name, None)  # computed from the parameter when asked
        self._load_prints.flush()
        if self._load_prints.pending > 2 * len(self.plain_to_param):  # nobody asked for a while
            self._digests_taken_at_load()  # bounds the samples held on the device

    def _load_sample(self, name: str) -> torch.Tensor | None:
        """The sample view of an unsharded plain parameter (made once: a view of the parameter's
        storage stays valid through updates, merges and release/resume), else None."""
        if name not in self._sample_views:
            param = self.params.get(self.plain_to_param.get(name, ""))
            plain = param is not None and not isinstance(param, DTensor)
            self._sample_views[name] = sample_view(param.data, self._load_prints.samples) if plain else None
        return self._sample_views[name]

    def _digests_taken_at_load(self) -> dict[str, str]:
        self._load_digests.update(self._load_prints.digests())  # waits for the device's pending copies
        return self._load_digests

    def _forget_load_prints(self) -> None:
        self._load_prints, self._load_digests = Fingerprints(), {}

    def _check(self, tensors: dict[str, torch.Tensor], complete: bool) -> dict[str, torch.Tensor]:
        """Check every name, shape and dtype and fuse into in-memory names; works on meta tensors too."""
        if any(storage.nbytes() == 0 for storage, _ in self._storages):
            raise WeightUpdateError(
                "weights are released: call /resume_memory_occupation with tags ['weights'] before pushing weights"
            )
        unknown = sorted(set(tensors) - set(self.checkpoint_shapes))
        shapes = sorted(
            f"{n}: got {tuple(t.shape)}, expected {self.checkpoint_shapes[n]}"
            for n, t in tensors.items()
            if n in self.checkpoint_shapes and tuple(t.shape) != self.checkpoint_shapes[n]
        )
        dtypes = sorted(f"{n}: {t.dtype}" for n, t in tensors.items() if not t.is_floating_point())
        missing = sorted(self.required_names - set(tensors)) if complete else []
        problems = [
            f"{label} ({len(names)}): {', '.join(names[:10])}{' ...' if len(names) > 10 else ''}"
            for label, names in [
                ("unknown tensor names", unknown),
                ("wrong shapes", shapes),
                ("non-floating dtypes", dtypes),
                ("missing tensors", missing),
            ]
            if names
        ]
        if problems:
            raise WeightUpdateError("weight update refused, nothing changed: " + "; ".join(problems))
        converted = {self.plain_to_param[n]: t for n, t in tensors.items() if n in self.plain_to_param}
        fused = {n: t for n, t in tensors.items() if n not in self.plain_to_param}
        try:
            built = checkpoint_to_model(self.model, fused) if fused else {}
        except ValueError as exc:
            raise WeightUpdateError(f"weight update refused, nothing changed: {exc}") from exc
        for name, full in built.items():
            param = self.params.get(name)
            if param is None or tuple(full.shape) != tuple(param.shape):
                expected = None if param is None else tuple(param.shape)
                raise WeightUpdateError(
                    f"weight update refused, nothing changed: {name} built with shape "
                    f"{tuple(full.shape)}, the model holds {expected} (incomplete expert group?)"
                )
        return {**converted, **built}

    def _stage(self, tensors: dict[str, torch.Tensor], complete: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Check, then build each local shard; no parameter changes here."""
        staged = []
        for name, full in self._check(tensors, complete).items():
            param = self.params[name]
            local = _local(param)
            if full.device != local.device or full.dtype != param.dtype:
                full = full.to(device=local.device, dtype=param.dtype)
            if isinstance(param, DTensor):
                full = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
            staged.append((local, full))
        return staged

    # ---- weight-update groups (lockstep) ----------------------------------------------------
    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
        timeout_s: float,
    ) -> None:
        """Join group `group_name` as rank `rank_offset + tp_rank`, on every rank or on none."""
        ranks = list(range(rank_offset, rank_offset + self.tp_size))
        where = (
            f"weight update group {group_name!r} at tcp://{master_address}:{master_port} "
            f"(world_size={world_size}, this engine's ranks {ranks})"
        )
        error, joined = None, None
        if group_name in self.weight_groups:
            error = f"{where} is already initialized: call /destroy_weights_update_group first"
        elif rank_offset < 1 or rank_offset + self.tp_size > world_size:
            error = (
                f"{where}: the engine's ranks must lie in 1..world_size-1 (rank 0 is the sender): "
                f"give rank_offset >= 1 and world_size >= rank_offset + tp_size ({self.tp_size})"
            )
        elif backend not in WEIGHT_GROUP_BACKENDS:
            error = f"{where}: backend={backend!r}: use one of {list(WEIGHT_GROUP_BACKENDS)}"
        else:
            if backend == "nccl" and self.device.type == "cpu":
                log.warning(
                    "weight update group %r: backend 'nccl' on a CPU engine, using 'gloo' (the sender "
                    "must use gloo too)",
                    group_name,
                )
                backend = "gloo"
            rank = rank_offset + self.tp_rank
            try:
                joined = join_weight_update_group(
                    master_address, master_port, rank, world_size, group_name, backend, timedelta(seconds=timeout_s)
                )
            except (RuntimeError, ValueError) as exc:  # DistStoreError / DistNetworkError on timeout
                error = f"rank {rank}: {_first_line(exc)}"
            else:
                device = self.device if backend == "nccl" else torch.device("cpu")
                stream = torch.cuda.Stream(device) if device.type == "cuda" else None
                self.weight_groups[group_name] = WeightGroup(joined, rank, world_size, device, stream)
        errors = self._gather(error)
        if any(errors):
            if joined is not None:  # another rank failed: leave no half-joined group behind
                self.weight_groups.pop(group_name)
                dist.destroy_process_group(joined)
            reasons = "; ".join(sorted({e for e in errors if e}))
            if all(e is None or e.startswith("rank ") for e in errors):
                raise WeightUpdateError(
                    f"could not join {where} within {timeout_s:g} s; group rank 0 (the sender) "
                    f"must join at the same time: {reasons}"
                )
            raise WeightUpdateError(reasons)

    def destroy_weights_update_group(self, group_name: str) -> None:
        group = self.weight_groups.pop(group_name, None)
        if group is None:
            raise WeightUpdateError(
                f"no weight update group {group_name!r} on this engine (have {sorted(self.weight_groups)})"
            )
        dist.destroy_process_group(group.group)

    def _gather(self, value):
        if self.group is None:
            return [value]
        out = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(out, value, group=self.group)
        return out

    def get_weights_by_name(self, name: str, truncate_size: int) -> list[float]:
        """First values of a parameter, by checkpoint name (per expert for MoE) or in-memory name."""
        self._restore_base_weights()
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
        self._restore_base_weights()
        mine = {name: tensor_sha256(_local(p)) for name, p in self.params.items()}
        return self._gather(mine)

    def weights_fingerprint(self, names: list[str] | None, samples: int) -> dict[str, str]:
        """Checkpoint name -> fingerprint of the full tensor (rollfleet.wire.fingerprint), for the
        given names (all when None); the sender computes the same over what it sent."""
        self._restore_base_weights()
        wanted = set(self.checkpoint_to_param) if names is None else set(names)
        unknown = sorted(wanted - set(self.checkpoint_to_param))
        if unknown:
            raise WeightUpdateError(f"names not in this model: {unknown[:10]}")
        start = time.perf_counter()
        taken = self._digests_taken_at_load()
        known = {} if samples != self._load_prints.samples else {name: taken[name] for name in wanted if name in taken}
        wanted -= set(known)
        # parameters stay alive anyway: gather their samples once, not every HOLD_BYTES
        collector = Fingerprints(samples=samples, hold_bytes=math.inf)
        for name in sorted(n for n in wanted if n in self.plain_to_param):
            collector.add(name, _full(self.params[self.plain_to_param[name]]))  # collective on DTensors
        fused = {self.checkpoint_to_param[n] for n in wanted if n not in self.plain_to_param}
        for param_name in sorted(fused):
            full = _full(self.params[param_name])  # collective on DTensors: every rank runs this loop
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

    @property
    def dtype(self) -> torch.dtype:
        return next(iter(self.params.values())).dtype

    # ---- LoRA (lockstep): merge on activation ------------------------------------------------
    # A batch runs with one adapter or none. `_use_lora` (at the start of every prefill and
    # decode) makes the weights match it: restore the base values of the previous adapter's
    # targets from saved copies (a copy back, never a subtraction, so the base is exact), save
    # copies of the new adapter's targets and set W = W_base + scale * B @ A there. The delta is
    # a full [out, in] tensor sliced to this rank's shard with distribute_tensor(src_data_rank=None),
    # as `_stage` slices weight updates, so tp and ep engines need nothing else and no rank talks
    # to another. Paths that read or replace base weights call `_restore_base_weights` first; the
    # adapter merges again on the next forward that asks for it.
    def load_lora_adapter(
        self,
        lora_name: str,
        lora_path: str | None = None,
        config_dict: dict | None = None,
        serialized_named_tensors: list[str] | None = None,
        load_format: str | None = None,
    ) -> None:
        """Store an adapter read from a directory (`lora_path`) or from this rank's entry of
        `serialized_named_tensors`; on every rank or, after any rank's refusal, on none."""
        adapter, error = None, None
        try:
            adapter = self._read_adapter(lora_name, lora_path, config_dict, serialized_named_tensors, load_format)
        except LoraError as exc:
            error = str(exc)
        errors = self._gather(error)
        if any(errors):
            raise LoraError("; ".join(sorted({e for e in errors if e})))
        self.lora_adapters[lora_name] = adapter

    def _read_adapter(self, lora_name, lora_path, config_dict, serialized_named_tensors, load_format) -> LoraAdapter:
        limits = self._lora_limits()
        if lora_name in self.lora_adapters:
            raise LoraError(
                f"lora_name={lora_name!r} is already loaded: unload it first (/unload_lora_adapter), "
                "or load under another name"
            )
        if limits.max_loaded is not None and len(self.lora_adapters) >= limits.max_loaded:
            raise LoraError(
                f"{len(self.lora_adapters)} adapters are loaded, --max-loaded-loras is "
                f"{limits.max_loaded}: unload one of {sorted(self.lora_adapters)} first"
            )
        if lora_path is not None:
            config, tensors = read_adapter_dir(lora_path)
        else:
            try:
                payload = safe_loads(serialized_named_tensors[self.tp_rank])
            except Exception as exc:  # untrusted bytes: every failure to rebuild them is the sender's, reported
                raise LoraError(
                    f"serialized_named_tensors[{self.tp_rank}] cannot be read: {type(exc).__name__}: {_first_line(exc)}"
                ) from exc
            try:
                tensors = _named_tensors(payload, load_format)
            except WeightUpdateError as exc:
                reason = str(exc).removeprefix("weight update refused, nothing changed: ")
                raise LoraError(f"adapter {lora_name!r} refused, nothing changed: {reason}") from exc
            config = config_dict
        return parse_adapter(
            lora_name, lora_path or TENSORS_PATH, config, tensors, self.model, self.lora_targetable, limits
        )

    def unload_lora_adapter(self, lora_name: str) -> None:
        self._lora_limits()
        if lora_name not in self.lora_adapters:
            raise LoraError(f"lora_name={lora_name!r} is not loaded (loaded: {sorted(self.lora_adapters)})")
        if self.active_lora == lora_name:
            self._restore_base_weights()
        del self.lora_adapters[lora_name]

    def lora_fingerprints(self, lora_name: str, names: list[str] | None, samples: int) -> dict[str, str]:
        """peft key -> fingerprint of the adapter's stored tensor (rollfleet.wire.fingerprint). Every
        rank decoded its own copy: a key whose ranks disagree gets a value that matches nothing."""
        self._lora_limits()
        adapter = self.lora_adapters.get(lora_name)
        if adapter is None:
            raise LoraError(f"lora_name={lora_name!r} is not loaded (loaded: {sorted(self.lora_adapters)})")
        mine = adapter.fingerprints(names, samples)
        ranks = self._gather(mine)
        return {
            name: value if all(r.get(name) == value for r in ranks) else f"ranks differ: {value}"
            for name, value in mine.items()
        }

    def _lora_limits(self) -> LoraLimits:
        if self.lora_limits is None:
            raise LoraError(
                "LoRA is off on this engine: start it with --enable-lora (and --max-lora-rank, "
                "--lora-target-modules as needed)"
            )
        return self.lora_limits

    @torch.no_grad()
    def _use_lora(self, lora_name: str | None) -> None:
        if lora_name == self.active_lora:
            return
        if lora_name is not None and lora_name not in self.lora_adapters:  # checked before anything changes
            raise LoraError(f"lora_name={lora_name!r} is not loaded (loaded: {sorted(self.lora_adapters)})")
        self._restore_base_weights()
        if lora_name is None:
            return
        self._forget_load_prints()
        for target in self.lora_adapters[lora_name].targets:
            param = self.params[f"{target.module}.weight"]
            local = _local(param)
            self._lora_base.append((local, local.clone()))
            delta = target.delta(local.device)
            if isinstance(param, DTensor):
                delta = distribute_tensor(delta, param.device_mesh, param.placements, src_data_rank=None).to_local()
            local.copy_((local.float() + delta).to(local.dtype))
        self.active_lora = lora_name

    @torch.no_grad()
    def _restore_base_weights(self) -> None:
        """Copy the saved base values back into the active adapter's targets (no-op without one)."""
        for local, base in self._lora_base:
            local.copy_(base)
        self._lora_base, self.active_lora = [], None

    # ---- memory (lockstep) ----------------------------------------------------------------
    def memory(self) -> list[dict[str, int]]:
        """Per rank: weight bytes and, on GPU, allocated / reserved / peak allocated / device used."""
        stats = self._memory()
        if self.device.type == "cuda":
            stats["peak_allocated"] = torch.cuda.max_memory_allocated(self.device)
        return self._gather(stats)

    def release_memory(self, tags: list[str]) -> list[dict[str, int]]:
        self._restore_base_weights()
        before = self._memory()
        self._held_payloads.clear()
        if WEIGHT_TAG in tags:
            for storage, _ in self._storages:
                storage.resize_(0)
            self.loaded_names = set()  # SGLang semantics: released weights must be pushed again
            self._forget_load_prints()
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
            stats.update(
                allocated=torch.cuda.memory_allocated(self.device),
                reserved=torch.cuda.memory_reserved(self.device),
                device_used=torch.cuda.mem_get_info(self.device)[1] - torch.cuda.mem_get_info(self.device)[0],
            )
        return stats

    def drop_held_payloads(self) -> None:
        """The sync is over: let the sender's buffers go."""
        self._held_payloads.clear()

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

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
