"""The sending side of LoRA sync: a peft model's adapter as named full tensors plus its config,
and the adapter directory peft's `save_pretrained` writes (adapter_config.json +
adapter_model.safetensors), which engines load with /load_lora_adapter.

Names are peft's saved naming (`base_model.model.<module>.lora_A.weight`, the adapter name
dropped), what `get_peft_model_state_dict` returns and what SGLang and the embedded engine read.
Which parameter each of its keys is depends only on the model's structure and the adapter's config,
so it is worked out once per model and adapter (`AdapterPlan`): peft walks every module several
times per call (12 ms for the bench model's 192 adapter tensors on the CPU, every sync).
"""

from __future__ import annotations

import copy
import json
import weakref
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch.distributed.tensor import DTensor

from rollfleet.weights.checkpoint import atomic_directory
from rollfleet.weights.gather import ShardGather
from rollfleet.wire.buckets import Bucket
from rollfleet.wire.hf_files import ADAPTER_CONFIG_FILE as CONFIG_FILE
from rollfleet.wire.hf_files import ADAPTER_WEIGHTS_FILE as WEIGHTS_FILE


class AdapterSource:
    """What the lora transport sends: an adapter's named tensors and its peft config; `directory`:
    where it already lies as a peft directory (engines then read it there), or None."""

    directory: str | None = None

    def config_dict(self) -> dict:
        raise NotImplementedError

    def named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        raise NotImplementedError


class SavedAdapter(AdapterSource):
    """A peft adapter directory (what `save_adapter` wrote): a restore sends it again."""

    WEIGHTS_FILE = WEIGHTS_FILE

    def __init__(self, directory: str | Path):
        self.directory = str(directory)

    def config_dict(self) -> dict:
        return json.loads((Path(self.directory) / CONFIG_FILE).read_text())

    def named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from load_file(Path(self.directory) / WEIGHTS_FILE).items()


class LoraSource(AdapterSource):
    """The LoRA adapter of a peft model (possibly FSDP2-sharded: `full_tensor()` is collective, so
    every rank iterates together and only the sending rank keeps the results)."""

    def __init__(self, model, adapter_name: str = "default", *, keep: bool = True):
        if adapter_name not in getattr(model, "peft_config", {}):
            raise ValueError(
                f"adapter_name={adapter_name!r} is not an adapter of this model (has "
                f"{sorted(getattr(model, 'peft_config', {}))}): give a peft model and one of its adapters"
            )
        self.model, self.adapter_name, self.keep = model, adapter_name, keep

    def config_dict(self) -> dict:
        """The adapter's peft config as adapter_config.json holds it (JSON types only); the plan's copy
        while the config is unchanged (peft's `to_dict` and the JSON round trip: 0.06 ms a call on this
        project's CPU, 0.004 ms from the plan)."""
        config = self.model.peft_config[self.adapter_name]
        plan = _PLANS.get(self.model, {}).get(self.adapter_name)
        if plan is not None and plan.same_config(config):
            return dict(plan.config)
        return adapter_config_dict(config)

    def named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        plans = _PLANS.setdefault(self.model, {})
        plan = plans.get(self.adapter_name)
        if plan is None or not plan.holds(self.model):
            from peft import get_peft_model_state_dict  # imported here: peft takes seconds to import

            # never the base layers (peft adds lm_head/embeddings' full weights when targeted): engines hold them
            state = get_peft_model_state_dict(self.model, adapter_name=self.adapter_name, save_embedding_layers=False)
            plan = plans[self.adapter_name] = AdapterPlan.of(self.model, self.adapter_name, state)
            items = state.items()
        else:
            items = plan.state()
        # FSDP2's row shards of every adapter tensor in ONE all-gather (none on a mesh of one rank),
        # not a full_tensor() each: 338 of them took 51 ms of a rank-32 push on 1 x H200
        full = next(ShardGather(keep=self.keep).full_tensors([dict(items)]))
        if self.keep:
            yield from full.items()


class AdapterPlan:
    """Which registered parameter each key of an adapter's peft state dict is, found once (the values
    peft returns are the parameters, detached). It holds while the model has the same adapters and
    config and every planned parameter is still registered at its module path (a wrap, a replaced
    or moved module or parameter, and a merge all show there); then `state()` is peft's state dict."""

    def __init__(self, model, adapter_name: str, entries: list[tuple[str, tuple[str, ...], str, torch.Tensor]]):
        self.adapter_name, self.entries = adapter_name, entries  # (peft key, module path, attribute, parameter)
        config = model.peft_config[adapter_name]
        self.adapters, self.config = tuple(model.peft_config), adapter_config_dict(config)
        self._fields = _fields_of(config)  # what `same_config` compares, without peft's to_dict

    def same_config(self, config) -> bool:
        """Whether `config` holds what the plan's did (its fields compared as they are: equal fields
        give the same `adapter_config_dict`); a config whose fields cannot be copied never is."""
        return self._fields is not None and vars(config) == self._fields

    @classmethod
    def of(cls, model, adapter_name: str, state: dict[str, torch.Tensor]) -> AdapterPlan | None:
        """The plan of `state` (peft's state dict of the adapter), or None when a value is not exactly one
        registered parameter (then peft is asked every time)."""
        registered: dict[Any, list] = {}
        for path, module in model.named_modules(remove_duplicate=False):
            for attribute, param in module._parameters.items():
                if param is not None:
                    registered.setdefault(_where(param), []).append(
                        (tuple(path.split(".")) if path else (), attribute, param)
                    )
        entries = []
        for key, value in state.items():
            found = registered.get(_where(value), [])
            if _where(value) is None or len(found) != 1:
                return None
            entries.append((key, *found[0]))
        return cls(model, adapter_name, entries)

    def holds(self, model) -> bool:
        config = model.peft_config.get(self.adapter_name)
        if tuple(model.peft_config) != self.adapters or config is None:
            return False
        if not self.same_config(config):
            if adapter_config_dict(config) != self.config:
                return False
            self._fields = _fields_of(config)  # changed to what gives the same dict: cheap again next time
        for _, path, attribute, param in self.entries:
            module = model
            for part in path:
                module = module._modules.get(part)
                if module is None:
                    return False
            if module._parameters.get(attribute) is not param:
                return False
        return True

    def state(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(peft key, parameter): the parameters themselves; ShardGather detaches what it yields (a
        DTensor's detach() here was a dispatch of its own, 336 of them 5.7 ms on the CPU)."""
        return ((key, param) for key, _, _, param in self.entries)


def _where(tensor: torch.Tensor):
    """What identifies a parameter's values: its (local) storage, offset, size, stride, dtype and full shape."""
    local = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
    if local.device.type == "meta" or local.untyped_storage().data_ptr() == 0:
        return None
    where = (local.untyped_storage().data_ptr(), local.storage_offset(), tuple(local.shape), local.stride())
    return (*where, local.dtype, local.device, tuple(tensor.shape))


def _fields_of(config) -> dict | None:
    """A deep copy of a peft config's fields (None where one cannot be copied)."""
    try:
        return copy.deepcopy(vars(config))
    except Exception:  # noqa: BLE001  (then the plan compares peft's to_dict, as before)
        return None


_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> adapter name -> AdapterPlan | None


def adapter_config_dict(config) -> dict:
    """A peft config -> plain JSON data, as save_pretrained writes it (sets become sorted lists)."""

    def plain(value):
        if isinstance(value, (set, frozenset)):
            return sorted(value)
        raise TypeError(f"adapter config value {value!r} ({type(value).__name__}) has no JSON form")

    return json.loads(json.dumps(config.to_dict(), default=plain))


def save_adapter(
    named_tensors: Iterable[tuple[str, torch.Tensor]], config_dict: dict, directory: str | Path, *, begun: bool = False
) -> Path:
    """Write a peft adapter directory, under a temporary name renamed at the end (a reader never
    sees a half-written adapter; `begun`: `atomic_directory`'s)."""
    tensors = {name: tensor.detach().to("cpu").contiguous() for name, tensor in named_tensors}
    with atomic_directory(directory, begun=begun) as partial:
        save_file(tensors, partial / WEIGHTS_FILE, metadata={"format": "pt"})
        (partial / CONFIG_FILE).write_text(json.dumps(config_dict, indent=2, sort_keys=True))
    return Path(directory)


def save_packed_adapter(bucket: Bucket, config_dict: dict, directory: str | Path, *, begun: bool = False) -> Path:
    """`save_adapter` of the tensors packed in `bucket` (rollfleet.weights.transports.lora): the whole
    bucket copied to the host at once, not one device copy per tensor (336 for rank 32 on every
    linear layer of the benches' model: 168 targets, each a synchronous copy), and written from views
    of that copy (safetensors takes views of one storage that do not overlap; cloning each, 7 of the
    36 ms a 49 MB write took on the CPU, bought nothing). The bucket holds the values as they were
    pushed; the trainer's parameters may have stepped since. On the CPU the views are of the bucket
    itself: its buffer must not be repacked before this returns (the lora transport waits for it)."""
    tensors = Bucket(host_copy(bucket.flattened_tensor), bucket.metadata).unpack()
    return save_adapter(tensors.items(), config_dict, directory, begun=begun)


def host_copy(flat: torch.Tensor) -> torch.Tensor:
    """`flat` on the host (itself when it is there), copied off the caller's stream: on a side
    stream, after everything queued on the current one (the pack that filled it), into pinned
    memory. A plain `.to("cpu")` is a pageable copy on the stream the sender's own kernels use: on
    an H100 a 49 MB LoRA bucket's took about 25 ms, and the push's fingerprint hashing, queued behind
    it on that stream while the engines loaded, waited for all of it (29 ms against 2.4 before)."""
    if flat.device.type != "cuda":
        return flat.to("cpu")
    packed = torch.cuda.Event()
    packed.record(torch.cuda.current_stream(flat.device))
    host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
    side = torch.cuda.Stream(flat.device)
    side.wait_event(packed)
    with torch.cuda.stream(side):
        host.copy_(flat, non_blocking=True)
    side.synchronize()
    return host
