"""What leaves the trainer as files: an HF model directory of the full weights (save_hf_dir), and the
resumable state, model and optimizer sharded with torch.distributed.checkpoint plus the step
(save_state, load_state). Every rank calls each of them: the gathers and the checkpoint are collective."""

from __future__ import annotations

import copy
import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from rollfleet.weights.checkpoint import save_checkpoint
from rollfleet.weights.source import ModuleSource

STATE_META = "trainer_state.json"
# Files of a model directory that are weights or are rewritten by save_hf; everything else
# (tokenizer, chat template, generation config) is copied as is.
_NOT_COPIED = ("config.json", "model.safetensors.index.json", "pytorch_model.bin.index.json")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def save_hf_dir(
    model: torch.nn.Module,
    weights: ModuleSource,
    path: Path,
    *,
    model_path: Path,
    rank: int,
    dtype: torch.dtype | None,
    max_shard_bytes: int,
) -> None:
    """`weights` (checkpoint names) in `dtype` (default: the fp32 master weights), as
    `model.safetensors` or, beyond `max_shard_bytes`, `model-0000i-of-0000n.safetensors` plus
    `model.safetensors.index.json`; config from the model; tokenizer and generation config copied
    from `model_path`, the directory the trainer loaded. Rank 0 writes."""
    with torch.no_grad():
        tensors = (
            (name, tensor.to(device="cpu", dtype=dtype or tensor.dtype)) for name, tensor in weights.named_tensors()
        )
        if rank != 0:
            for _ in tensors:  # the gathers are collective: every rank walks the source
                pass
        else:
            save_checkpoint(tensors, path, shard_bytes=max_shard_bytes)
            config = copy.deepcopy(model.config)
            config.dtype = dtype or torch.float32
            config.save_pretrained(path)
            for source in sorted(model_path.iterdir()):
                if source.is_file() and source.name not in _NOT_COPIED and not source.name.endswith(_WEIGHT_SUFFIXES):
                    shutil.copy2(source, path / source.name)
    dist.barrier()


def save_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    path: Path,
    *,
    options: StateDictOptions,
    rank: int,
    meta: Mapping[str, Any],
) -> None:
    """Model + optimizer (every rank writes its own shard, so `path` must be one directory every rank
    can reach) and `meta` (JSON: the step, the world size, the caller's extra), written by rank 0."""
    model_state, optim_state = get_state_dict(model, optimizer, options=options)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(path))
    if rank == 0:
        (path / STATE_META).write_text(json.dumps(dict(meta), indent=2) + "\n")
    dist.barrier()


def load_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: Path, *, options: StateDictOptions
) -> dict[str, Any]:
    """Restore what `save_state` wrote (any world size; DCP reshards) and return its meta."""
    if not (path / STATE_META).is_file():
        raise FileNotFoundError(
            f"{path} holds no trainer state ({STATE_META} is missing); "
            "pass a directory written by PolicyTrainer.save_state"
        )
    model_state, optim_state = get_state_dict(model, optimizer, options=options)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
        options=options,
    )
    return json.loads((path / STATE_META).read_text())


def state_options(lora: bool) -> StateDictOptions:
    """A LoRA run's state holds what trains (the adapter and its optimizer state), not the frozen base
    (which a load therefore leaves as the trainer loaded it from the model path)."""
    return StateDictOptions(ignore_frozen_params=lora, strict=not lora)
