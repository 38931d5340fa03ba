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
    compile_layers: bool = False,
) -> torch.nn.Module:
    """`lora_config`: a LoRA run's train config; the trainable model is wrapped with peft before sharding.
    `compile_layers`: each decoder layer's forward compiled (`compiled_forwards`)."""
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
    if compile_layers:
        compiled_forwards(layers)
    if trainable:
        model.train()
    else:
        model.eval().requires_grad_(False)
    return model


COMPILE_BACKEND = "inductor"  # the tests compile with "aot_eager" (no code generation on the CPU)


def compiled_forwards(layers: list[torch.nn.Module]) -> None:
    """torch.compile each layer's forward, in place (train.compile). The forward, not the module: names stay
    those of the checkpoint (a compiled module's parameters would be under `_orig_mod.`), and FSDP2's hooks,
    which run around the forward in `Module.__call__`, stay outside the compiled code. All layers share one
    code object, whose cache holds an entry per layer, grad mode (the old log-probs run without), adapter
    state (a LoRA run's reference) and shape: at dynamo's default of 8 entries a 2-layer LoRA model with
    a KL reference ran eagerly after its first steps, so the limit is raised to cover them."""
    dynamo = torch._dynamo.config
    dynamo.cache_size_limit = max(dynamo.cache_size_limit, 16 * len(layers))  # recompile_limit in newer torch
    dynamo.accumulated_cache_size_limit = max(dynamo.accumulated_cache_size_limit, 64 * len(layers))
    for layer in layers:
        layer.forward = torch.compile(layer.forward, backend=COMPILE_BACKEND)


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
