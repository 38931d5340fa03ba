"""The runner of one tensor-parallel rank of the embedded engine, over the model build.py built: prefill
and decode with a KV cache, weight reads, memory release and resume.

Every method called through `Action` (lockstep.py) is a *lockstep action*: tp rank 0 decides,
broadcasts the action with its arguments, and every rank runs the same method in the same order.
Methods that use collectives (weight updates, full tensors, fingerprints) rely on that. Weight
updates live in `self.weights` (weight_update.py), LoRA adapters in `self.lora` (lora_merge.py),
which is also the only handle on the parameters.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

import torch
from transformers import DynamicCache

from rollfleet.engine.kv.paged import PagedModel, fuse_fast_path, paged_support
from rollfleet.engine.lora.lora import LoraLimits
from rollfleet.engine.lora.lora_merge import LoraMerge
from rollfleet.engine.model.build import build_model
from rollfleet.engine.model.route_capture import RouteCapture
from rollfleet.engine.tp.ranks import Ranks
from rollfleet.engine.tp.shards import full_of, local_of, tensor_sha256
from rollfleet.engine.weights.load_prints import LoadPrints
from rollfleet.engine.weights.remote_instance import RemoteInstance
from rollfleet.engine.weights.weight_groups import WeightGroups, WeightUpdateError
from rollfleet.engine.weights.weight_storage import HostCopy, own_storages, unique_storages
from rollfleet.engine.weights.weight_update import SYNC_TIMING, WeightSchema, WeightUpdater
from rollfleet.wire.errors import RESUME_REFUSED
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
        lora: LoraLimits | None = None,
        mark: Callable[[str], object] | None = None,
        paged: dict | None = None,
    ):
        """`mark(phase)`: called as each phase of the build ends (the engine's start timing); `paged`:
        PagedModel's options (page_size, graphs) to run on the paged KV pool (kv/paged.py) when the
        model allows it, else None (or a model it cannot serve): transformers' own cache."""
        mark = mark or (lambda phase: None)
        self.tp_size, self.ep_size, self.device = tp_size, ep_size, torch.device(device)
        self.ranks = Ranks(group)  # gloo group of this engine's ranks (None when tp_size == 1)
        built = build_model(model_path, dtype, dummy, device=self.device, tp_size=tp_size, ep_size=ep_size)
        self.model = built.eval().requires_grad_(False)
        fuse_fast_path(self.model, paged, self.device, tp_size, ep_size)  # before its storages are listed
        mark("model_build")
        params = dict(self.model.named_parameters(remove_duplicate=False))
        self.dtype = next(iter(params.values())).dtype
        self.schema = WeightSchema.of(self.model, params)
        own_storages(params)
        self._storages = unique_storages(params)  # (storage, bytes when resident)
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
        self.route_capture = RouteCapture(self.model)
        self.last_routes: torch.Tensor | None = None  # [batch, positions, layers, top_k] of the last forward asked
        self.host_copy = HostCopy()  # of released weights, with --enable-weights-cpu-backup
        why_not = paged_support(self.model.config) if paged is not None else "not asked for"
        where = {"tp_size": tp_size, "device": self.device}
        self.paged = None if why_not else PagedModel(self.model, self.lora, self.route_capture, **where, **paged)
        if paged is not None and why_not:
            log.warning("the paged KV pool cannot serve this model (%s): transformers' own cache is used", why_not)
        mark("model_prepare")

    @property
    def weights_ready(self) -> bool:
        return self.weights.ready

    def weights_released(self) -> bool:
        return any(storage.nbytes() == 0 for storage, _ in self._storages)

    def _refuse_unloaded_reads(self) -> None:
        """Weight reads see only loaded values. Released weights would touch freed memory (a SIGSEGV
        on CPU); weights not loaded since start or release (a dummy start, a resume) hold no values
        yet, and must not pass for a model. Every rank holds the same state (lockstep), so every rank
        refuses alike, before any collective."""
        if self.weights_released():
            raise WeightUpdateError(
                f"weights are released: call /resume_memory_occupation with tags {[WEIGHT_TAG]} first"
            )
        if not self.weights.ready:
            missing = sorted(self.schema.required_names - self.weights.loaded_names)
            raise WeightUpdateError(
                f"weights are not loaded: {len(missing)} tensors have had no values since the start (dummy) or "
                f"the last release, e.g. {missing[:3]}: push every weight (or /update_weights_from_disk) first"
            )

    # ---- generation (lockstep) ----------------------------------------------------------
    @torch.inference_mode()
    def prefill(
        self, prompts: list[list[int]], lora_name: str | None = None, keep: int = 1, capture_routes: bool = False
    ) -> torch.Tensor:
        """Start a batch: left-pad the prompts, fill a fresh KV cache, return last-position logits
        ([batch, vocab]; with keep > 1 the last `keep` positions', [batch, keep, vocab], for input
        logprobs), on this rank's device: sampling happens there (sampling.py). The whole batch runs
        with one LoRA adapter, or none. `capture_routes`: keep the routers' choices in `last_routes`
        (route_capture.py)."""
        self.lora.use(lora_name)
        width = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        mask = torch.zeros(len(prompts), width, dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        self.mask = mask.to(self.device)
        positions = (self.mask.cumsum(-1) - 1).clamp(min=0)
        self.next_position = positions[:, -1:] + 1
        self.cache = DynamicCache(config=self.model.config)
        return self._forward(ids.to(self.device), positions, keep, capture_routes)

    @torch.inference_mode()
    def decode(self, tokens: list[int], lora_name: str | None = None, capture_routes: bool = False) -> torch.Tensor:
        self.lora.use(lora_name)  # merged again if a read or update restored the base mid-batch
        self.mask = torch.cat([self.mask, self.mask.new_ones(len(tokens), 1)], dim=1)
        ids = torch.tensor(tokens, dtype=torch.long)[:, None].to(self.device)
        logits = self._forward(ids, self.next_position, 1, capture_routes)
        self.next_position = self.next_position + 1
        return logits

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, keep: int, capture_routes: bool) -> torch.Tensor:
        self.last_routes = None
        if capture_routes:
            self.route_capture.start()
        out = self.model(
            input_ids=ids,
            attention_mask=self.mask,
            position_ids=positions,
            cache=self.cache,
            use_cache=True,
            logits_to_keep=keep,
        )
        if capture_routes:
            self.last_routes = self.route_capture.stop(*ids.shape)
        logits = out.logits[:, -keep:, :]
        return logits[:, -1, :] if keep == 1 else logits

    def keep_rows(self, rows: list[int]) -> None:
        """Drop finished sequences from the running batch."""
        index = torch.tensor(rows, dtype=torch.long).to(self.device)
        self.cache.batch_select_indices(index)
        self.mask, self.next_position = self.mask[index], self.next_position[index]

    def end_batch(self) -> None:
        self.cache = None

    # ---- weight reads (lockstep) ----------------------------------------------------------
    def get_weights_by_name(self, name: str, truncate_size: int) -> list[float]:
        """First values of a parameter, by checkpoint name (per expert for MoE) or in-memory name."""
        self._refuse_unloaded_reads()
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
        self._refuse_unloaded_reads()
        params = self.lora.base_params()
        return self.ranks.gather({name: tensor_sha256(local_of(p)) for name, p in params.items()})

    def weights_fingerprint(self, names: list[str] | None, samples: int) -> dict[str, str]:
        """Checkpoint name -> fingerprint of the full tensor (rollfleet.wire.fingerprint), for the
        given names (all when None); the sender computes the same over what it sent."""
        self._refuse_unloaded_reads()
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
        """Free the tagged memory still held (a tag released before frees nothing more: clients
        release all tags again while one is still released, as SGLang allows); with `cpu_backup`
        (SGLang's --enable-weights-cpu-backup) complete weights are copied to the host first (pinned
        memory beside a GPU) and come back on resume, bit-exact and ready to serve."""
        params = self.lora.base_params()  # no adapter's saved base values outlive the weights (nor are copied)
        before = self._memory()
        self.weights.drop_held_payloads()
        if WEIGHT_TAG in tags:
            if not self.weights_released():  # a second release keeps the first one's copy
                self.host_copy.drop()
                if cpu_backup and self.weights.ready:
                    self.host_copy.take(self._storages, pin=self.device.type == "cuda")
            self._free_weights(params)
        if KV_CACHE_TAG in tags:
            self.cache = None
        if self.paged is not None:
            if WEIGHT_TAG in tags:
                self.paged.drop_graphs()  # the weights' addresses change on resume
            self.paged.release(tags)  # kv_cache, cuda_graph: paused in place with the memory saver
        self._empty_cache()
        return self.ranks.gather({"before": before, "after": self._memory()})

    def resume_memory(self, tags: list[str]) -> list[dict[str, int]]:
        self.ranks.agree(self._resume_refusal(tags), ValueError)  # before anything changes, on every rank
        before = self._memory()
        if WEIGHT_TAG in tags:
            self._allocate_weights()
            if self.host_copy.restore(self._storages):
                self.weights.mark_loaded()
        if self.paged is not None:
            self.paged.resume(tags)
        return self.ranks.gather({"before": before, "after": self._memory()})

    def _resume_refusal(self, tags: list[str]) -> str | None:
        """Why this rank cannot resume `tags` now (None: it can)."""
        if self.device.type != "cuda":
            return None
        mapped, allocated = self.paged.resume_bytes(tags) if self.paged is not None else (0, 0)
        if WEIGHT_TAG in tags:
            allocated += sum(nbytes for storage, nbytes in self._storages if storage.nbytes() == 0)
        free, _ = torch.cuda.mem_get_info(self.device)
        cached = torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
        return resume_refusal(tags, self.device, mapped, allocated, free, cached)

    def update_weights_from_disk(self, model_path: str) -> list[str]:
        """A disk update loads every tensor, so SGLang-style clients send it whatever the memory state
        (AReaL's colocated cycle sends it while weights are released): released weights are
        allocated again first, and released again if the update is refused (nothing changed: a host
        copy of them is kept for the resume); a loaded update replaces the host copy."""
        if not self.weights_released():
            return self.weights.from_disk(model_path)
        self._allocate_weights()
        try:
            names = self.weights.from_disk(model_path)
        except WeightUpdateError:
            self._free_weights(self.lora.base_params())
            raise
        self.host_copy.drop()
        return names

    def _free_weights(self, params: dict[str, torch.Tensor]) -> None:
        for storage, _ in unique_storages(params):
            storage.resize_(0)
        self.weights.forget_loaded()
        self.load_prints.forget()

    def _allocate_weights(self) -> None:
        """Released storages get their size back, without values."""
        if self.paged is not None:
            self.paged.drop_graphs()  # new addresses: graphs captured on the old ones would read freed memory
        for storage, nbytes in self._storages:
            if storage.nbytes() == 0:
                storage.resize_(nbytes)

    def _memory(self) -> dict[str, int]:
        weight_bytes = sum(storage.nbytes() for storage, _ in self._storages)
        stats = {"weight_bytes": weight_bytes, "held_payloads": self.weights.held_payloads, **self.host_copy.stats()}
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


def resume_refusal(tags: list[str], device, mapped: int, allocated: int, free: int, cached: int) -> str | None:
    """Why a resume of `tags` must not start (None: it fits): it maps `mapped` bytes through the memory
    saver (device memory only: a map the device cannot back ends the process, as SGLang's does) and
    allocates `allocated` through torch's allocator (its `cached` free blocks count), with `free` bytes
    free on the device. Refused, nothing changes and the engine keeps serving its other calls."""
    if mapped <= free and mapped + allocated <= free + cached:
        return None
    gib = 1 << 30
    return (
        f"resume_memory_occupation of tags {tags} {RESUME_REFUSED} "
        f"{(mapped + allocated) / gib:.2f} GiB on {device} and {free / gib:.2f} GiB is free there "
        f"(+{cached / gib:.2f} GiB cached by this engine): another process holds the rest (a colocated "
        "trainer that kept its memory, or buffers this engine received from it through CUDA IPC and "
        "dropped since, which its sender frees at torch.cuda.ipc_collect()); free it, then resume again"
    )
