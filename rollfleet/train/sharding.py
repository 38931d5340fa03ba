"""Building the trainer's model: joining the default process group, the device and compute dtype a
trainer runs in, and a HF causal LM sharded with FSDP2, every decoder layer then the root."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from transformers import AutoModelForCausalLM

from rollfleet.config import TrainConfig
from rollfleet.train import lora


def init_distributed(
    rank: int, world_size: int, master_addr: str = "127.0.0.1", master_port: int = 29500, backend: str | None = None
) -> None:
    """Join the default process group (gloo on CPU, NCCL when a GPU is visible); the trainer needs one."""
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":  # one GPU per rank: LOCAL_RANK under torchrun, else the rank (one node)
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
    dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{master_port}", rank=rank, world_size=world_size)


def load_sharded(
    model_path: Path,
    mesh: DeviceMesh,
    compute_dtype: torch.dtype,
    *,
    trainable: bool,
    lora_config: TrainConfig | None = None,
) -> torch.nn.Module:
    """`lora_config`: a LoRA run's train config; the trainable model is wrapped with peft before sharding."""
    # Every rank reads the full checkpoint on CPU, then keeps its shard (moved to the mesh's device).
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    if trainable and lora_config is not None:
        model = lora.wrap(model, lora_config)  # peft freezes the base; the adapter is sharded with it
    layer_classes = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in layer_classes]
    if not layers:
        raise ValueError(
            f"{type(model).__name__} names no decoder layer class in _no_split_modules; cannot shard it layer by layer"
        )
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    if trainable:
        model.train()
    else:
        model.eval().requires_grad_(False)
    return model


def default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def compute_dtype_for(mixed_precision: str, device: torch.device) -> torch.dtype:
    if mixed_precision == "bf16" and device.type != "cuda":
        raise ValueError(
            f"mixed_precision='bf16' needs a GPU; this trainer runs on {device} "
            "(fix: set mixed_precision to 'auto' or 'fp32')"
        )
    if mixed_precision == "bf16" or (mixed_precision == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return torch.float32
