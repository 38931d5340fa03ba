"""Weight updates of one rank: receive, check, stage, apply; all or nothing across ranks.

Every update has the same four steps. Receive: read a checkpoint, decode this rank's tensor
payload, or receive a group's broadcasts. Check: every name, full shape and dtype against a
schema built once from the model (meta tensors through transformers' reverse conversion), fusing
experts with transformers' converters. Stage: slice each rank's shard (`shard_of`, the slices of
a fresh load); no parameter changes yet. Apply: only when every rank staged without refusal
(`Ranks.agree`), copy into the existing storages, so ties and pointers survive.
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from rollfleet.engine.lora.lora_merge import LoraMerge
from rollfleet.engine.tp.payloads import (
    BucketViews,
    PayloadError,
    decode_entry,
    named_tensors,
    resident_payload,
)
from rollfleet.engine.tp.ranks import Ranks
from rollfleet.engine.tp.shards import local_of, shard_of
from rollfleet.engine.weights.load_prints import LoadPrints
from rollfleet.engine.weights.weight_groups import WeightGroups, WeightUpdateError, parse_specs
from rollfleet.wire.control_requests import MAPPING_NOT_HELD, RESIDENT_LOAD_FORMAT
from rollfleet.wire.hf_files import CheckpointReadError, read_checkpoint
from rollfleet.wire.naming import checkpoint_to_model, model_to_checkpoint, plain_names

log = logging.getLogger("rollfleet.engine")
SYNC_TIMING = os.environ.get("ROLLFLEET_SYNC_TIMING") == "1"  # log each weight update's phases (CPU time)
REFUSED = "weight update refused, nothing changed: "
Produce = Callable[[], tuple[dict[str, torch.Tensor], bool]]  # -> (checkpoint name -> tensor, complete?)


@dataclass(frozen=True)
class WeightSchema:
    """Checkpoint name -> in-memory parameter and full shape, computed once on meta tensors."""

    checkpoint_shapes: dict[str, tuple[int, ...]]
    checkpoint_to_param: dict[str, str]
    required_names: frozenset[str]  # one checkpoint name per stored tensor (tied copies left out)
    plain_to_param: dict[str, str]  # where the checkpoint tensor IS the parameter (no conversion)
    param_shapes: dict[str, tuple[int, ...]]  # in-memory name -> full shape

    @classmethod
    def of(cls, model: nn.Module, params: dict[str, torch.Tensor]) -> WeightSchema:
        shapes, to_param, required = {}, {}, set()
        unique = {id(p): name for name, p in model.named_parameters()}
        for name, param in params.items():
            meta = {name: torch.empty(param.shape, dtype=param.dtype, device="meta")}
            for ckpt_name, tensor in model_to_checkpoint(model, meta).items():
                shapes[ckpt_name] = tuple(tensor.shape)
                to_param[ckpt_name] = name
                if unique.get(id(param)) == name:
                    required.add(ckpt_name)
        plain = {ckpt: name for name, ckpt in plain_names(model).items()}
        param_shapes = {name: tuple(param.shape) for name, param in params.items()}
        return cls(shapes, to_param, frozenset(required), plain, param_shapes)


class WeightUpdater:
    def __init__(
        self,
        model: nn.Module,
        schema: WeightSchema,
        lora: LoraMerge,
        ranks: Ranks,
        load_prints: LoadPrints,
        groups: WeightGroups,
        *,
        released: Callable[[], bool],
        loaded: bool,
    ):
        self.model, self.schema, self.lora, self.ranks = model, schema, lora, ranks
        self.load_prints, self.groups, self.released = load_prints, groups, released
        self.loaded_names: set[str] = set(schema.required_names) if loaded else set()
        # Bumped by every change of the base weights' values (an update applied, a release, a
        # receive, a restore): KV made under one generation is not another's (the prefix cache's key).
        self.generation = 0
        # The last two decoded tensor payloads stay referenced until the sync ends: a sender
        # alternates two buffers, and a buffer still referenced here is not mapped again (opening a
        # CUDA IPC handle costs far more than reading a few hundred MB).
        self._held_payloads: deque = deque(maxlen=2)
        self._views = BucketViews()  # the tensors of those buffers, for the same layouts again
        # load_format "rollfleet_resident": (mapping id, checkpoint name -> the sender's own tensor),
        # kept across syncs and releases (they are the sender's memory: holding them costs this
        # engine nothing), replaced by the next mapping a sender sends
        self._resident: tuple[str, dict[str, torch.Tensor]] | None = None

    @property
    def ready(self) -> bool:
        """Every tensor loaded since start or release."""
        return self.schema.required_names <= self.loaded_names

    def forget_loaded(self) -> None:
        """The weights were released (SGLang semantics: released weights must be pushed again)."""
        self.loaded_names = set()
        self.generation += 1
        self.drop_held_payloads()

    def mark_loaded(self) -> None:
        """Every tensor is whole again without a load through this class: received in place from a
        seed (R-Fork, rollfleet.engine.weights.remote_instance), or released weights back from their host copy."""
        self.loaded_names = set(self.schema.required_names)
        self.generation += 1

    def drop_held_payloads(self) -> None:
        """The sync is over: let the sender's buffers go."""
        self._held_payloads.clear()
        self._views.clear()

    @property
    def resident_mapping(self) -> str | None:
        """The id of the resident mapping this rank keeps (a sender may then send the id alone)."""
        return None if self._resident is None else self._resident[0]

    @property
    def held_payloads(self) -> int:
        """Decoded payloads still referenced (their sender's buffers cannot be freed while they are)."""
        return len(self._held_payloads)

    # ---- the three ways in (lockstep); each returns the checkpoint names it applied ----------
    def from_disk(self, model_path: str) -> list[str]:
        def read():
            try:
                return read_checkpoint(model_path), True
            except CheckpointReadError as exc:
                raise WeightUpdateError(str(exc)) from exc

        return self.apply(read)

    def from_tensor(self, serialized_named_tensors: list[str], load_format: str | None = None) -> list[str]:
        """Every rank decodes its own entry, `serialized_named_tensors[tp_rank]` (SGLang's rule)."""
        mapped: list[tuple[str, dict[str, torch.Tensor]]] = []  # a resident mapping, kept once applied

        def decode():
            try:
                payload = decode_entry(serialized_named_tensors, self.ranks.rank)
                if load_format == RESIDENT_LOAD_FORMAT:
                    return self._resident_tensors(payload, mapped), False
                self._held_payloads.append(payload)
                return named_tensors(payload, load_format, self.ranks.rank, self._views), False
            except PayloadError as exc:
                reason = str(exc) if str(exc).startswith("serialized_named_tensors[") else REFUSED + str(exc)
                raise WeightUpdateError(reason) from exc

        names = self.apply(decode)
        # The sender's buffers are read here through CUDA IPC / shared memory: finish reading them
        # before answering, since the sender reuses or frees them once every engine has answered.
        self._synchronize()
        if mapped:
            self._resident = mapped[0]  # the last one goes: its tensors' handles are closed
        return names

    def _resident_tensors(self, payload, mapped: list) -> dict[str, torch.Tensor]:
        """A "rollfleet_resident" entry's tensors: sent (kept, in `mapped`, once applied) or kept."""
        mapping, tensors = resident_payload(payload, self.ranks.rank)
        if tensors is not None:
            mapped.append((mapping, tensors))
            return dict(tensors)
        if self._resident is None or self._resident[0] != mapping:
            raise PayloadError(
                f"load_format={RESIDENT_LOAD_FORMAT!r}: mapping {mapping!r} {MAPPING_NOT_HELD} "
                f"(held: {self.resident_mapping!r}; a restarted engine holds none): send the mapping with its tensors"
            )
        return dict(self._resident[1])

    def from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str,
        load_format: str | None = None,
    ) -> list[str]:
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

        def receive():
            self.groups.get(group_name)
            specs = parse_specs(names, dtypes, shapes)
            if load_format == "flattened_bucket" and not specs:
                raise WeightUpdateError("load_format='flattened_bucket' with no tensors: nothing was received")
            refusal = self._refusal_of_announced(specs, names)
            tensors = self.groups.receive(group_name, specs, load_format)
            if refusal is not None:
                raise WeightUpdateError(f"{refusal} (the broadcast was received and dropped)")
            return tensors, False

        return self.apply(receive)

    def _refusal_of_announced(self, specs, names: list[str]) -> WeightUpdateError | None:
        try:
            self.check({name: torch.empty(shape, dtype=dtype, device="meta") for name, dtype, shape in specs}, False)
        except WeightUpdateError as exc:
            return exc
        duplicates = sorted(name for name, count in Counter(names).items() if count > 1)
        if duplicates:
            return WeightUpdateError(f"{REFUSED}names sent twice: {', '.join(duplicates[:10])}")
        return None

    # ---- check, stage, apply -----------------------------------------------------------------
    def apply(self, produce: Produce) -> list[str]:
        """Receive with `produce`, check and stage; apply on every rank or, after any refusal, on none."""
        params = self.lora.base_params()
        clock, staged, refusal, tensors = [time.perf_counter()], [], None, {}
        try:
            tensors, complete = produce()
            clock.append(time.perf_counter())
            staged = self.stage(tensors, complete, params)
        except WeightUpdateError as exc:
            refusal = str(exc)
        clock.append(time.perf_counter())
        self.ranks.agree(refusal, WeightUpdateError)
        self.generation += 1  # before the copy: one that fails part-way has changed values too
        clock.append(time.perf_counter())
        with torch.no_grad():
            same_device = [(t, v) for t, v in staged if t.device == v.device]
            if same_device:  # one multi-tensor copy (casting where dtypes differ), not a launch per tensor
                torch._foreach_copy_([t for t, _ in same_device], [v for _, v in same_device])
            for target, value in staged:
                if target.device != value.device:
                    target.copy_(value)
        self.loaded_names |= set(tensors)
        self.load_prints.take(tensors, params)
        if SYNC_TIMING:
            clock.append(time.perf_counter())
            phases = zip(("receive", "stage", "gather", "copy"), (b - a for a, b in zip(clock, clock[1:])))
            log.warning(
                "weight update of %d tensors: %s",
                len(tensors),
                " ".join(f"{name}={seconds * 1e3:.2f}ms" for name, seconds in phases),
            )
        return sorted(tensors)

    def check(self, tensors: dict[str, torch.Tensor], complete: bool) -> dict[str, torch.Tensor]:
        """Check every name, shape and dtype and fuse into in-memory names; works on meta tensors too."""
        if self.released():
            raise WeightUpdateError(
                "weights are released: call /resume_memory_occupation with tags ['weights'] before pushing weights"
            )
        shapes_of = self.schema.checkpoint_shapes
        unknown = sorted(set(tensors) - set(shapes_of))
        shapes = sorted(
            f"{n}: got {tuple(t.shape)}, expected {shapes_of[n]}"
            for n, t in tensors.items()
            if n in shapes_of and tuple(t.shape) != shapes_of[n]
        )
        dtypes = sorted(f"{n}: {t.dtype}" for n, t in tensors.items() if not t.is_floating_point())
        missing = sorted(self.schema.required_names - set(tensors)) if complete else []
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
            raise WeightUpdateError(REFUSED + "; ".join(problems))
        plain = self.schema.plain_to_param
        converted = {plain[n]: t for n, t in tensors.items() if n in plain}
        fused = {n: t for n, t in tensors.items() if n not in plain}
        try:
            built = checkpoint_to_model(self.model, fused) if fused else {}
        except ValueError as exc:
            raise WeightUpdateError(f"{REFUSED}{exc}") from exc
        for name, full in built.items():
            expected = self.schema.param_shapes.get(name)
            if tuple(full.shape) != expected:
                raise WeightUpdateError(
                    f"{REFUSED}{name} built with shape {tuple(full.shape)}, the model holds {expected} "
                    "(incomplete expert group?)"
                )
        return {**converted, **built}

    def stage(
        self, tensors: dict[str, torch.Tensor], complete: bool, params: dict[str, torch.Tensor]
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Check, then build each local shard; no parameter changes here."""
        staged = []
        for name, full in self.check(tensors, complete).items():
            param = params[name]
            local = local_of(param)
            if full.device != local.device:  # cast with the move (a host checkpoint: fewer bytes moved)
                full = full.to(device=local.device, dtype=param.dtype)
            # on the same device a cast waits for `apply`'s copy (a sender's fp32 tensors: no temporary)
            staged.append((local, shard_of(full, param)))
        return staged

    def _synchronize(self) -> None:
        device = self.groups.device
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
