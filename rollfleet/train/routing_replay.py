"""Routing replay (`train.routing_replay`): the trainer's MoE layers use the experts the ENGINE chose.

Why: a MoE token's logprob depends on which top-k experts it went to. Engine and trainer compute the
router logits with different kernels and precision (bf16 engine, fp32 trainer), so near-tied logits
pick different experts on the two sides, and the trainer scores a token with another network than
the one that sampled it: a large logprob mismatch and a biased importance ratio. Replaying the
engine's choices (SGLang's `meta_info.routed_experts`, R3 in the literature; slime and verl do the
same) removes that source of mismatch.

How: a forward hook on each decoder layer's router replaces the router's own top-k indices by the
engine's, and recomputes the gate weights from the trainer's router logits at those experts
(softmax over all experts, gathered, renormalised when the router normalises its top-k), so the
router still gets gradients. Positions the engine did not route (the last output token, padding)
keep the router's own choice; their logits are not trained on.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from transformers import AutoConfig

from rollfleet.wire.routed_experts import decode_routed_experts, moe_routers, routing_shape

OWN_CHOICE = -1  # a position whose routes the router picks itself


def check_replayable(model_path: str) -> None:
    """At start: routing replay needs a MoE model (ValueError naming the setting and the fix)."""
    if routing_shape(AutoConfig.from_pretrained(model_path)) is None:
        raise ValueError(
            f"train.routing_replay=true: {model_path} is a dense model (its config has no experts), there "
            "are no expert choices to replay (fix: set train.routing_replay=false, or train a MoE model)"
        )


class RoutingReplay:
    """Forces one model's routers to given routes inside `forcing(routes)`; does nothing outside it."""

    def __init__(self, model: torch.nn.Module):
        self.routers = moe_routers(model)
        if not self.routers:
            raise ValueError(
                f"train.routing_replay=true: {type(model).__name__} has no MoE router (transformers' "
                "router_logits outputs) to replay routes into (fix: set train.routing_replay=false)"
            )
        self.shape = routing_shape(model.config)  # (layers, top_k)
        self._forced: torch.Tensor | None = None  # [tokens, layers, top_k] during forcing
        for layer, router in self.routers.items():
            router.register_forward_hook(self._hook(layer))

    @contextlib.contextmanager
    def forcing(self, routes: torch.Tensor | None) -> Iterator[None]:
        """`routes` [rows, positions, layers, top_k]: expert ids, OWN_CHOICE where the router decides."""
        self._forced = None if routes is None else routes.reshape(-1, *routes.shape[2:])
        try:
            yield
        finally:
            self._forced = None

    def _hook(self, layer: int):
        def replay(module, _args, output):
            if self._forced is None:
                return None
            logits, _weights, own = output
            chosen = self._forced[:, layer].to(own.device)
            if chosen.shape != own.shape:
                raise ValueError(f"routes for {tuple(chosen.shape)} tokens x top_k, the router saw {tuple(own.shape)}")
            indices = torch.where(chosen == OWN_CHOICE, own, chosen)
            weights = torch.softmax(logits, dim=-1, dtype=torch.float).gather(-1, indices)
            if getattr(module, "norm_topk_prob", False):
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return logits, weights.to(logits.dtype), indices

        return replay


def replay_routes(items: Sequence[Mapping[str, Any] | None], width: int, shape: tuple[int, int]) -> torch.Tensor:
    """[rows, width, layers, top_k] from each item's `routed_experts` (SGLang's base64, positions
    0 .. len(prompt + output) - 2), OWN_CHOICE elsewhere; None items are padding rows."""
    routes = torch.full((len(items), width, *shape), OWN_CHOICE, dtype=torch.long)
    for row, item in enumerate(items):
        if item is not None:
            decoded = decode_routed_experts(item["routed_experts"], *shape)
            routes[row, : decoded.shape[0]] = decoded
    return routes


def check_replay_batch(batch: Sequence[Mapping[str, Any]], shape: tuple[int, int]) -> None:
    """Every item carries routes for every position the engine fed through the model."""
    for index, item in enumerate(batch):
        if not item.get("routed_experts"):
            raise ValueError(
                f"batch[{index}] has no routed_experts, and train.routing_replay=true replays them "
                "(fix: generate with return_routed_experts=true on engines started with "
                "--enable-return-routed-experts, or set train.routing_replay=false)"
            )
        positions = len(item["prompt_ids"]) + len(item["output_ids"]) - 1
        tokens = decode_routed_experts(item["routed_experts"], *shape).shape[0]
        if tokens != positions:
            raise ValueError(
                f"batch[{index}] has routed_experts for {tokens} positions, its prompt and output need "
                f"{positions} (len(prompt) + len(output) - 1; ask with routed_experts_start_len=0)"
            )
