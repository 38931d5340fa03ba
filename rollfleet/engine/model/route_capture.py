"""Which experts the routers chose, for SGLang's `return_routed_experts` (rollfleet.wire.routed_experts).

A forward hook on every decoder layer's router keeps the router's own top-k indices (it does not
change them), only during a forward the scheduler asked routes of. The router runs before the
experts, on replicated weights and full hidden states, so with TP or EP every rank sees the same
global expert ids; rank 0's are the answer.
"""

from __future__ import annotations

import torch

from rollfleet.wire.routed_experts import moe_routers, routing_shape


class RouteCapture:
    """Records `[batch, positions, num_hidden_layers, top_k]` int32 routes of one forward at a time."""

    def __init__(self, model: torch.nn.Module):
        self.routers = moe_routers(model)
        self.shape = routing_shape(model.config) if self.routers else None
        self._taken: dict[int, torch.Tensor] | None = None  # layer -> [tokens, top_k] while recording
        for layer, router in self.routers.items():
            router.register_forward_hook(self._hook(layer))

    @property
    def available(self) -> bool:
        return bool(self.routers)

    def _hook(self, layer: int):
        def keep_indices(_module, _args, output):
            if self._taken is not None:
                self._taken[layer] = output[2].detach().to("cpu", torch.int32)

        return keep_indices

    def start(self) -> None:
        self._taken = {}

    def stop(self, batch: int, positions: int) -> torch.Tensor:
        """The routes of the forward since `start`; layers without a router hold zeros (as SGLang's buffer)."""
        taken, self._taken = self._taken, None
        num_layers, top_k = self.shape
        routes = torch.zeros(batch * positions, num_layers, top_k, dtype=torch.int32)
        for layer, indices in taken.items():
            routes[:, layer] = indices
        return routes.view(batch, positions, num_layers, top_k)
