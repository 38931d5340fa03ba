"""Routed experts as SGLang returns them (`meta_info.routed_experts`), and the MoE routers of a model.

SGLang 0.5.23 (`--enable-return-routed-experts`, request `return_routed_experts: true`) answers, for
a finished request, the base64 of the raw bytes of an int32 tensor `[tokens, num_hidden_layers,
top_k]`: the experts each decoder layer's router chose for every token that went through the model,
positions `[routed_experts_start_len, prompt_len + output_len - 1)` (the last output token is
sampled, never fed back). Layers without a router (dense layers of a MoE model) hold zeros.

The engine records routes and the trainer replays them (`train.routing_replay`); both find the
routers the same way: transformers' own record of a model's router outputs
(`_can_record_outputs["router_logits"]`, what `output_router_logits=True` collects), one router per
decoder layer, named `...layers.<i>....`.
"""

from __future__ import annotations

import base64
import re

import torch

ROUTED_EXPERTS_FLAG = "--enable-return-routed-experts"  # the server flag, SGLang's and the embedded engine's
_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def encode_routed_experts(routes: torch.Tensor) -> str:
    """SGLang's wire form: base64 of the int32 bytes, row-major `[tokens, layers, top_k]`."""
    return base64.b64encode(routes.to(torch.int32).contiguous().numpy().tobytes()).decode("ascii")


def decode_routed_experts(encoded: str, num_layers: int, top_k: int) -> torch.Tensor:
    """`[tokens, num_layers, top_k]` int64 from SGLang's base64 (ValueError when the size does not fit)."""
    raw = base64.b64decode(encoded.encode("ascii"), validate=True)
    per_token = 4 * num_layers * top_k
    if len(raw) % per_token:
        raise ValueError(
            f"routed_experts holds {len(raw)} bytes, not a whole number of tokens of {num_layers} layers x "
            f"top_k={top_k} int32 ({per_token} bytes each): it was recorded for another model"
        )
    flat = torch.frombuffer(bytearray(raw), dtype=torch.int32)
    return flat.view(-1, num_layers, top_k).long()


def routing_shape(config) -> tuple[int, int] | None:
    """(num_hidden_layers, num_experts_per_tok) of a MoE config; None for a dense model."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    top_k = getattr(config, "num_experts_per_tok", None)
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    if not top_k or not experts:
        return None
    return int(config.num_hidden_layers), int(top_k)


def moe_routers(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """Decoder layer index -> its router module (empty for a dense model). A router's forward returns
    `(router_logits, top_k_weights, top_k_indices)` over the flattened tokens (transformers 5's MoE
    routers, e.g. Qwen3-MoE's `Qwen3MoeTopKRouter`)."""
    recorders = getattr(model, "_can_record_outputs", None) or {}
    recorder = recorders.get("router_logits")
    if recorder is None:
        return {}
    router_class = getattr(recorder, "target_class", recorder)
    routers: dict[int, torch.nn.Module] = {}
    for name, module in model.named_modules():
        if isinstance(module, router_class):
            match = _LAYER_INDEX.search(name)
            if match is None:
                raise ValueError(f"router {name!r} ({type(module).__name__}) is in no decoder layer 'layers.<i>.'")
            routers[int(match.group(1))] = module
    return routers
