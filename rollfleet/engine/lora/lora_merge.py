"""LoRA serving by merge on activation, and the one way to the model's parameters.

A batch runs with one adapter or none. `use(name)` (at the start of every prefill and decode)
makes the weights match it: restore the base values of the previous adapter's targets from saved
copies (a copy back, never a subtraction, so the base is exact), save copies of the new
adapter's targets and set W = W_base + scale * B @ A there (an input embedding's [num_embeddings,
dim] weight: + scale * (B @ A).T, targets.py). The delta is a full tensor of the weight's shape,
sliced to this rank's shard (`shard_of`), as weight updates are sliced, so tp and ep engines need
nothing else and no rank talks to another.

Every path that reads or replaces base weights gets the parameters from `base_params()`, which
restores the base first: there is no other handle on them. The adapter merges again on the
next forward that asks for it.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

import torch
from torch import nn

from rollfleet.engine.lora.host_copies import copies_on
from rollfleet.engine.lora.lora import LoraAdapter, LoraError, LoraLimits, parse_adapter, read_adapter_dir
from rollfleet.engine.lora.parse_plan import AdapterPlans
from rollfleet.engine.lora.targets import lora_targets
from rollfleet.engine.tp.payloads import BucketViews, PayloadError, decode_entry, named_tensors, resident_entry
from rollfleet.engine.tp.ranks import Ranks
from rollfleet.engine.tp.shards import local_of, shard_of
from rollfleet.wire.control_requests import MAPPING_NOT_HELD, RESIDENT_LOAD_FORMAT

log = logging.getLogger("rollfleet.engine")
SYNC_TIMING = os.environ.get("ROLLFLEET_SYNC_TIMING") == "1"  # as weights/weight_update.py: log each load's phases
LORA_OFF = (
    "LoRA is off on this engine: start it with --enable-lora (and --max-lora-rank, --lora-target-modules as needed)"
)


class LoraMerge:
    def __init__(
        self,
        model: nn.Module,
        params: dict[str, torch.Tensor],
        limits: LoraLimits | None,
        ranks: Ranks,
        on_merge: Callable[[], None],
    ):
        self._model, self._params, self._ranks = model, params, ranks
        self.limits = limits  # None: LoRA is off (no --enable-lora)
        self.targetable = lora_targets(model, params, ranks.size)
        self.adapters: dict[str, LoraAdapter] = {}
        self._loads = 0  # adapters loaded since start: each load's number names its weights (`identity`)
        self._load_of: dict[str, int] = {}
        self.active: str | None = None  # the adapter merged into the weights now
        self._saved: list[tuple[torch.Tensor, torch.Tensor]] = []  # (local weight, its saved base values)
        self._on_merge = on_merge  # weights changed other than by an update (forgets load fingerprints)
        # the last adapter payload decoded from tensors, kept referenced: a sender that reuses its
        # buffer (it may: adapters are copied at load) then finds it mapped still, and the next load
        # opens no CUDA IPC handle (weight_update.py keeps its payloads for the same reason)
        self._held_payload = None
        # its id where it came as load_format "rollfleet_resident": a sender's next load may name it alone
        self._mapping: str | None = None
        self._views = BucketViews(limit=1)  # the tensors of that buffer, for the same layout again
        self.plans = AdapterPlans()  # and what their last parse found, for the same adapter again

    @torch.no_grad()
    def base_params(self) -> dict[str, torch.Tensor]:
        """The parameters (in-memory name -> parameter) holding base weights: the active adapter's
        targets are restored first (a no-op without one)."""
        for local, base in self._saved:
            local.copy_(base)
        self._saved, self.active = [], None
        return self._params

    @torch.no_grad()
    def use(self, lora_name: str | None) -> None:
        """Make the weights those of `lora_name` merged into the base (None: the base)."""
        if lora_name == self.active:
            return
        if lora_name is not None and lora_name not in self.adapters:  # checked before anything changes
            raise LoraError(f"lora_name={lora_name!r} is not loaded (loaded: {sorted(self.adapters)})")
        params = self.base_params()
        if lora_name is None:
            return
        self._on_merge()
        targets = self.adapters[lora_name].targets
        device = local_of(params[f"{targets[0].module}.weight"]).device if targets else None
        phases = _Phases(device) if SYNC_TIMING else None  # each phase's device work waited for, and logged
        halves = copies_on(
            {f"{i} {half}": t for i, target in enumerate(targets) for half, t in target.halves().items()}, device
        )  # one transfer per host storage (the adapter as it arrived), not two per target
        weights = [params[f"{target.module}.weight"] for target in targets]
        saved = _views_of_one_buffer([local_of(w) for w in weights])
        scratch = _delta_scratch(weights, device)
        if phases:
            phases.mark("to_device")
        for i, (target, param, base) in enumerate(zip(targets, weights, saved)):
            local = local_of(param)
            self._saved.append((local, base.copy_(local)))
            # W = (W + scale * B @ A) in float32, rounded once: `delta(...).add_(W)` is `W.float() + delta`
            # (an exact widening, a commutative add) into one float32 [out, in] scratch for every target
            out = None if scratch is None else scratch[: local.numel()].view(local.shape)
            delta = shard_of(target.delta(local.device, halves[f"{i} A"], halves[f"{i} B"], out=out), param)
            local.copy_(delta.add_(local))
        self.active = lora_name
        if phases:
            phases.mark("targets")
            log.warning("lora merge of %s: %d targets %s", lora_name, len(targets), phases)

    def merge_bytes(self) -> int:
        """What a merged adapter holds on the weights' device beside them at most: a saved copy of each
        weight it may target (--lora-target-modules, else every targetable one); 0 with LoRA off."""
        if self.limits is None:
            return 0
        wanted = self.limits.target_modules
        chosen = [path for path in self.targetable if wanted is None or path.rsplit(".", 1)[-1] in wanted]
        return sum(local_of(self._params[f"{path}.weight"]).nbytes for path in chosen)

    def identity(self, lora_name: str | None) -> str:
        """What the weights of `lora_name` are, as the KV they make depends on it: the base, or the
        adapter's name and the number of its load (one unloaded and loaded again under the same name
        may hold other weights)."""
        if lora_name is None:
            return "base"
        return f"{lora_name!r} load {self._load_of.get(lora_name, 'none')}"

    # ---- adapters (lockstep) -----------------------------------------------------------------
    def load(
        self,
        lora_name: str,
        lora_path: str | None = None,
        config_dict: dict | None = None,
        serialized_named_tensors: list[str] | None = None,
        load_format: str | None = None,
    ) -> None:
        """Store an adapter read from a directory (`lora_path`) or from this rank's entry of
        `serialized_named_tensors`; on every rank or, after any rank's refusal, on none."""
        adapter, refusal, start, marks = None, None, time.perf_counter(), {}
        try:
            adapter, marks = self._read(lora_name, lora_path, config_dict, serialized_named_tensors, load_format)
        except LoraError as exc:
            refusal = str(exc)
        read = time.perf_counter()
        self._ranks.agree(refusal, LoraError)
        if SYNC_TIMING:  # read = tensors (decode the payload, open its CUDA IPC handles) + parse (checks, host copy)
            parts = " ".join(f"{name}={seconds * 1e3:.2f}ms" for name, seconds in marks.items())
            read_ms, agree_ms = (read - start) * 1e3, (time.perf_counter() - read) * 1e3
            log.warning("lora load of %s: read=%.2fms (%s) agree=%.2fms", lora_name, read_ms, parts, agree_ms)
        self.adapters[lora_name] = adapter
        self._loads += 1
        self._load_of[lora_name] = self._loads

    def unload(self, lora_name: str) -> None:
        self._require_enabled()
        if lora_name not in self.adapters:
            raise LoraError(f"lora_name={lora_name!r} is not loaded (loaded: {sorted(self.adapters)})")
        if self.active == lora_name:
            self.base_params()
        del self.adapters[lora_name]
        del self._load_of[lora_name]

    def fingerprints(self, lora_name: str, names: list[str] | None, samples: int) -> dict[str, str]:
        """peft key -> fingerprint of the adapter's stored tensor (rollfleet.wire.fingerprint). Every
        rank decoded its own copy: a key whose ranks disagree gets a value that matches nothing."""
        self._require_enabled()
        adapter = self.adapters.get(lora_name)
        if adapter is None:
            raise LoraError(f"lora_name={lora_name!r} is not loaded (loaded: {sorted(self.adapters)})")
        mine = adapter.fingerprints(names, samples)
        ranks = self._ranks.gather(mine)
        return {
            name: value if all(r.get(name) == value for r in ranks) else f"ranks differ: {value}"
            for name, value in mine.items()
        }

    def _read(
        self, lora_name, lora_path, config_dict, serialized_named_tensors, load_format
    ) -> tuple[LoraAdapter, dict[str, float]]:
        """The adapter, and the seconds of its phases (`tensors`, `parse`)."""
        limits = self._require_enabled()
        if lora_name in self.adapters:
            raise LoraError(
                f"lora_name={lora_name!r} is already loaded: unload it first (/unload_lora_adapter), "
                "or load under another name"
            )
        began = time.perf_counter()
        if lora_path is not None:
            config, tensors = read_adapter_dir(lora_path)
        else:
            try:
                payload = decode_entry(serialized_named_tensors, self._ranks.rank)
            except PayloadError as exc:
                raise LoraError(str(exc)) from exc
            try:
                mapping, payload, load_format = self._mapped(payload, load_format)
                tensors = named_tensors(payload, load_format, self._ranks.rank, self._views)
            except PayloadError as exc:
                raise LoraError(f"adapter {lora_name!r} refused, nothing changed: {exc}") from exc
            self._held_payload, self._mapping = payload, mapping
            config = config_dict
        tensors_at = time.perf_counter()
        if lora_path is not None:
            adapter = parse_adapter(lora_name, lora_path, config, tensors, self._model, self.targetable, limits)
        else:
            adapter = self.plans.parse(lora_name, config, tensors, self._model, self.targetable, limits)
        return adapter, {"tensors": tensors_at - began, "parse": time.perf_counter() - tensors_at}

    def _mapped(self, payload, load_format: str | None) -> tuple[str | None, object, str | None]:
        """A "rollfleet_resident" entry -> (its mapping id, the bucket it carries or the one held under
        that id, "flattened_bucket"); any other entry -> (None, itself, its format)."""
        if load_format != RESIDENT_LOAD_FORMAT:
            return None, payload, load_format
        mapping, bucket = resident_entry(payload)
        if bucket is None:
            if self._mapping != mapping:
                raise PayloadError(
                    f"load_format={RESIDENT_LOAD_FORMAT!r}: mapping {mapping!r} {MAPPING_NOT_HELD} (held: "
                    f"{self._mapping!r}; a restarted engine holds none): send the mapping with its bucket"
                )
            bucket = self._held_payload
        return mapping, bucket, "flattened_bucket"

    def _require_enabled(self) -> LoraLimits:
        if self.limits is None:
            raise LoraError(LORA_OFF)
        return self.limits


def _views_of_one_buffer(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Uninitialized tensors shaped as `tensors`, all views of ONE allocation on their device. A
    colocated engine empties the allocator's cache at every turn (model.py, release_memory), so the
    next merge's saved copies were as many device allocations as targets (168 for every linear layer
    of 24 layers), each a cudaMalloc."""
    if not tensors:
        return []
    offsets, end = [], 0
    for tensor in tensors:
        offsets.append(end)
        end += -(-tensor.nbytes // 64) * 64  # each view aligned for any dtype
    buffer = torch.empty(end, dtype=torch.uint8, device=tensors[0].device)
    return [
        buffer[start : start + t.nbytes].view(t.dtype).view(t.shape) for start, t in zip(offsets, tensors, strict=True)
    ]


def _delta_scratch(weights: list[torch.Tensor], device: torch.device | None) -> torch.Tensor | None:
    """One float32 buffer every target's delta is computed into (the largest target's size), where each
    delta is the weight itself (no tensor-parallel shard is cut from it); else None (one each)."""
    if not weights or any(local_of(w) is not w for w in weights):
        return None
    return torch.empty(max(w.numel() for w in weights), dtype=torch.float32, device=device)


class _Phases:
    """ROLLFLEET_SYNC_TIMING's split of a merge. Made after the device finished what was queued before
    (`earlier`: an overlapped step still running, a resume), and each mark waits for the device, so
    each figure is its phase's whole cost; `str` gives the total, then each phase."""

    def __init__(self, device: torch.device | None):
        self.device, self.ms = device, {}
        self.begin = self.last = time.perf_counter()
        self.mark("earlier")
        self.begin, self.cpu = self.last, time.thread_time()

    def mark(self, name: str) -> None:
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self.ms[name], self.last = (now - self.last) * 1e3, now

    def __str__(self) -> str:
        split = " ".join(f"{name}={ms:.2f}ms" for name, ms in self.ms.items())
        # this thread's CPU time over the merge: far below the total, it waited (the device, or the GIL
        # held by the server's threads while requests arrive)
        cpu = (time.thread_time() - self.cpu) * 1e3
        return f"{(self.last - self.begin) * 1e3:.2f}ms ({split}; thread cpu={cpu:.2f}ms)"
