"""One job: an adapter that arrives again as the same tensors is parsed once.

A colocated trainer packs every push of its adapter into the same buffer with the same layout
(rollfleet.weights.transports.lora, when every engine copies adapters at load), and the engine that
holds that buffer gets the same tensors back for it (rollfleet.engine.tp.payloads.BucketViews). Its
parse (`parse_adapter`: every key matched and checked against the model, the config and the limits;
one fingerprint sample view and one owned view per tensor) then finds what it found the last time:
for a rank-32 adapter on every linear layer of 24 (336 tensors) 2.8 ms on this project's 2-core CPU,
3.4-4 ms of an H100 host's load.

`AdapterPlans` keeps what a successful parse found, as an `AdapterPlan`: the tensors it was given
(the very objects, so no other tensor can match), a copy of the config, the limits, the targets'
modules and scales, where each tensor lies in the one storage they share, and where their
fingerprint samples lie in it. A load whose tensors are those objects, under an equal config and
equal limits, is the same adapter: it is copied (one copy of the storage's span, each tensor a view
of the copy, as `owned_copies` makes them) and sampled (one index gather per dtype, the elements
`sample_view` takes) without being checked again. Anything else is parsed in full, its refusals
unchanged, and replaces the plan (a plan holds its tensors, so it is dropped as soon as they are not
the latest: the sender's memory is held no longer than the payload it came in).
"""

from __future__ import annotations

import copy

import torch

from rollfleet.engine.lora.host_copies import SPAN_ALIGN
from rollfleet.engine.lora.lora import TENSORS_PATH, LoraAdapter, LoraLimits, parse_adapter
from rollfleet.engine.lora.targets import LoraTarget, factor_keys
from rollfleet.wire.fingerprint import DEFAULT_SAMPLES, Fingerprints, sample_positions


class AdapterPlan:
    def __init__(self, tensors: dict[str, torch.Tensor], config: dict, limits: LoraLimits, adapter: LoraAdapter):
        """Only through `of`, which checks the tensors fit a plan."""
        values = list(tensors.values())
        self.keys, self.sources = list(tensors), values
        self.config, self.limits = copy.deepcopy(config), limits
        self.targets = [(t.module, t.scale, t.embedding) for t in adapter.targets]
        self.device = values[0].device
        offsets = [t.storage_offset() * t.element_size() for t in values]
        self.start = min(offsets) // SPAN_ALIGN * SPAN_ALIGN
        self.end = max(o + t.nbytes for o, t in zip(offsets, values))
        # each tensor: (dtype, shape, stride, offset in elements of its dtype from the copy's start)
        self.views = [
            (t.dtype, tuple(t.shape), t.stride(), (o - self.start) // t.element_size()) for o, t in zip(offsets, values)
        ]
        by_dtype: dict[torch.dtype, tuple[list, list]] = {}
        for key, (dtype, shape, _, offset), tensor in zip(self.keys, self.views, values):
            positions = sample_positions(tensor.numel(), DEFAULT_SAMPLES) + offset
            index, records = by_dtype.setdefault(dtype, ([], []))
            index.append(positions)
            records.append((key, shape, positions.numel()))
        self.samples = [
            (dtype, torch.cat(index).to(self.device), records) for dtype, (index, records) in by_dtype.items()
        ]

    @classmethod
    def of(
        cls, tensors: dict[str, torch.Tensor], config: dict, limits: LoraLimits, adapter: LoraAdapter
    ) -> AdapterPlan | None:
        """A plan of a parse that succeeded, where its tensors allow one: every tensor a contiguous,
        non-empty view of one storage, at an offset that is a whole number of its elements."""
        values = list(tensors.values())  # a parse that succeeded had some, and a dict config
        storage = values[0].untyped_storage()
        for tensor in values:
            if (
                tensor.numel() == 0
                or not tensor.is_contiguous()
                or tensor.untyped_storage().data_ptr() != storage.data_ptr()
                or tensor.device != values[0].device
            ):
                return None
        return cls(tensors, config, limits, adapter)

    def matches(self, tensors: dict[str, torch.Tensor], config, limits: LoraLimits) -> bool:
        """Whether a load of `tensors` under `config` and `limits` is the adapter this plan parsed."""
        return (
            len(tensors) == len(self.sources)
            and all(a is b for a, b in zip(tensors.values(), self.sources))
            and list(tensors) == self.keys
            and limits == self.limits
            and config == self.config
        )

    def adapter(self, name: str, config: dict) -> LoraAdapter:
        """The adapter as `parse_adapter` makes it, from the tensors' current values."""
        size = -(-(self.end - self.start) // SPAN_ALIGN) * SPAN_ALIGN  # every dtype can view the whole copy
        owned_bytes = torch.empty(size, dtype=torch.uint8, device=self.device)
        source = torch.empty(0, dtype=torch.uint8, device=self.device).set_(self.sources[0].untyped_storage())
        owned_bytes[: self.end - self.start].copy_(source[self.start : self.end])
        typed = {dtype: owned_bytes.view(dtype) for dtype, *_ in self.samples}
        owned = {
            key: typed[dtype].as_strided(shape, stride, offset)
            for key, (dtype, shape, stride, offset) in zip(self.keys, self.views)
        }
        prints = Fingerprints(samples=DEFAULT_SAMPLES)
        for dtype, index, records in self.samples:
            prints.add_gathered(records, typed[dtype][index])
        if self.device.type == "cuda":  # the sender reuses its buffer once the engine answered
            torch.cuda.current_stream(self.device).synchronize()
        targets = [
            LoraTarget(module, owned[key_a], owned[key_b], scale, embedding=embedding)
            for module, scale, embedding in self.targets
            for key_a, key_b in [factor_keys(module, embedding)]
        ]
        return LoraAdapter(name, TENSORS_PATH, config, owned, targets, load_prints=prints)


class AdapterPlans:
    """The plan of the last adapter parsed from tensors (one: a LoRA sender reuses one buffer). A
    plan is made only when a load's tensors lie in the storage the load before parsed in full did:
    a sender that packs every version into a fresh buffer never gets the same tensors back, and
    making a plan costs about a full parse (4 ms for 336 tensors on this project's CPU), so it
    would pay that for nothing at every load."""

    def __init__(self):
        self.plan: AdapterPlan | None = None
        self.hits = 0  # loads served by the plan (tests and timing logs read it)
        self._last_storage: int | None = None  # where the last load parsed in full lay (an address only)

    def parse(self, name: str, config, tensors: dict[str, torch.Tensor], model, targetable, limits) -> LoraAdapter:
        """`parse_adapter(name, TENSORS_PATH, ...)`, by the plan where the load is the one it parsed."""
        plan = self.plan
        if plan is not None and plan.matches(tensors, config, limits):
            self.hits += 1
            return plan.adapter(name, config)
        self.plan = None  # its tensors are not the latest: let them go before anything else can fail
        adapter = parse_adapter(name, TENSORS_PATH, config, tensors, model, targetable, limits)
        storage = next(iter(tensors.values())).untyped_storage().data_ptr()  # a parsed adapter has tensors
        if storage == self._last_storage:  # the sender's buffer again
            self.plan = AdapterPlan.of(tensors, config, limits, adapter)
        self._last_storage = storage
        return adapter
