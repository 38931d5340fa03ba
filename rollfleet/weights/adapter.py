"""The sending side of LoRA sync: a peft model's adapter as named full tensors plus its config,
and the adapter directory peft's `save_pretrained` writes (adapter_config.json +
adapter_model.safetensors), which engines load with /load_lora_adapter.

Names are peft's saved naming (`base_model.model.<module>.lora_A.weight`, the adapter name
dropped), what `get_peft_model_state_dict` returns and what SGLang and the embedded engine read.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch.distributed.tensor import DTensor

from rollfleet.weights.checkpoint import atomic_directory
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
        """The adapter's peft config as adapter_config.json holds it (JSON types only)."""
        return adapter_config_dict(self.model.peft_config[self.adapter_name])

    def named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        from peft import get_peft_model_state_dict  # imported here: peft takes seconds to import

        # never the base layers (peft adds lm_head/embeddings' full weights when they are targets): engines hold them
        state = get_peft_model_state_dict(self.model, adapter_name=self.adapter_name, save_embedding_layers=False)
        for name, tensor in state.items():
            full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
            if self.keep:
                yield name, full.detach()


def adapter_config_dict(config) -> dict:
    """A peft config -> plain JSON data, as save_pretrained writes it (sets become sorted lists)."""

    def plain(value):
        if isinstance(value, (set, frozenset)):
            return sorted(value)
        raise TypeError(f"adapter config value {value!r} ({type(value).__name__}) has no JSON form")

    return json.loads(json.dumps(config.to_dict(), default=plain))


def save_adapter(named_tensors: Iterable[tuple[str, torch.Tensor]], config_dict: dict, directory: str | Path) -> Path:
    """Write a peft adapter directory, under a temporary name renamed at the end (a reader never
    sees a half-written adapter)."""
    tensors = {name: tensor.detach().to("cpu").contiguous() for name, tensor in named_tensors}
    with atomic_directory(directory) as partial:
        save_file(tensors, partial / WEIGHTS_FILE, metadata={"format": "pt"})
        (partial / CONFIG_FILE).write_text(json.dumps(config_dict, indent=2, sort_keys=True))
    return Path(directory)
