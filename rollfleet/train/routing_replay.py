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

Proof that it happened: each train step reports `replay_routes` (the (position, layer) routing
decisions the policy's forward took from the engine) and `replay_changed_share` (the share of them
where the engine's experts differ from the ones the trainer's router would have picked: the routing
mismatch replay removed).
"""

from __future__ import annotations

import base64
import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
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
        text = model.config.get_text_config()
        self.num_experts = int(getattr(text, "num_experts", None) or text.num_local_experts)
        self._forced: torch.Tensor | None = None  # [tokens, layers, top_k] during forcing
        self._counts: torch.Tensor | None = None  # decisions replayed, of which changed (on the device)
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
            replayed = (chosen != OWN_CHOICE).all(dim=-1)
            changed = replayed & (chosen.sort(dim=-1).values != own.sort(dim=-1).values).any(dim=-1)
            counts = torch.stack([replayed.sum(), changed.sum()]).double()
            self._counts = counts if self._counts is None else self._counts + counts
            indices = torch.where(chosen == OWN_CHOICE, own, chosen)
            weights = torch.softmax(logits, dim=-1, dtype=torch.float).gather(-1, indices)
            if getattr(module, "norm_topk_prob", False):
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return logits, weights.to(logits.dtype), indices

        return replay

    def check(self, batch: Sequence[Mapping[str, Any]]) -> None:
        """Every item carries routes for this model's layout (check_replay_batch)."""
        check_replay_batch(batch, self.shape, self.num_experts)

    def figures(self, device: torch.device) -> dict[str, float]:
        """The decisions replayed since the last call and the share the engine routed differently,
        summed over ranks (a collective: every rank calls it), then reset."""
        counts = torch.zeros(2, dtype=torch.float64, device=device)
        if self._counts is not None:
            counts += self._counts.to(device)
        dist.all_reduce(counts, op=dist.ReduceOp.SUM)
        self._counts = None
        replayed, changed = counts.tolist()
        return {"replay_routes": int(replayed), "replay_changed_share": changed / max(replayed, 1.0)}


def replay_routes(items: Sequence[Mapping[str, Any] | None], width: int, shape: tuple[int, int]) -> torch.Tensor:
    """[rows, width, layers, top_k] from each item's `routed_experts` (SGLang's base64, positions
    0 .. len(prompt + output) - 2), OWN_CHOICE elsewhere; None items are padding rows."""
    routes = torch.full((len(items), width, *shape), OWN_CHOICE, dtype=torch.long)
    for row, item in enumerate(items):
        if item is not None:
            decoded = decode_routed_experts(item["routed_experts"], *shape)
            routes[row, : decoded.shape[0]] = decoded
    return routes


def check_replay_batch(batch: Sequence[Mapping[str, Any]], shape: tuple[int, int], num_experts: int) -> None:
    """Every item carries routes for every position the engine fed through the model, recorded for a
    model of this layout (`shape` (layers, top_k), `num_experts` per layer): ValueError otherwise."""
    for index, item in enumerate(batch):
        if not item.get("routed_experts"):
            raise ValueError(
                f"batch[{index}] has no routed_experts, and train.routing_replay=true replays them "
                "(fix: generate with return_routed_experts=true on engines started with "
                "--enable-return-routed-experts, or set train.routing_replay=false)"
            )
        positions = len(item["prompt_ids"]) + len(item["output_ids"]) - 1
        _check_route_count(index, item["routed_experts"], positions, shape)
        routes = decode_routed_experts(item["routed_experts"], *shape)
        if routes.numel() and (routes.min() < 0 or routes.max() >= num_experts):
            raise ValueError(
                f"batch[{index}] routed_experts name expert {int(routes.max())} (min {int(routes.min())}), this "
                f"trainer's model has experts 0..{num_experts - 1} per layer: {_OTHER_MODEL}"
            )


_OTHER_MODEL = (
    "the engines route with another model than the trainer's (fix: serve the trainer's model, same "
    "num_hidden_layers, num_experts_per_tok and num_experts, or set train.routing_replay=false)"
)


def _check_route_count(index: int, encoded: str, positions: int, shape: tuple[int, int]) -> None:
    """One (layers x top_k) row of expert ids per position. A whole number of rows of another size
    means the engine's model routes another layout; of this size but too few or many, other positions."""
    ids, per_position = len(base64.b64decode(encoded)) // 4, shape[0] * shape[1]
    if ids == positions * per_position:
        return
    if ids % per_position == 0 and not (positions and ids % positions == 0):
        raise ValueError(
            f"batch[{index}] has routed_experts for {ids // per_position} positions, its prompt and output need "
            f"{positions} (len(prompt) + len(output) - 1; ask with routed_experts_start_len=0)"
        )
    raise ValueError(
        f"batch[{index}] routed_experts hold {ids} expert ids for {positions} positions, this trainer's model "
        f"routes {shape[0]} layers x top_k={shape[1]} = {per_position} per position: {_OTHER_MODEL}"
        + (
            f" (or routes for {ids // per_position} positions: ask with routed_experts_start_len=0)"
            if not ids % per_position and ids // per_position < positions
            else ""
        )
    )
