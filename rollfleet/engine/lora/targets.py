"""What of a model a LoRA adapter may target, and one target's arithmetic.

Two kinds of module take an adapter (peft's naming of their factors in brackets):
- an nn.Linear whose weight [out, in] is one parameter of its own (not tied, not fused experts):
  A [r, in], B [out, r] (`lora_A.weight`, `lora_B.weight`); delta = scale * B @ A.
- the input embedding, an nn.Embedding whose weight [num_embeddings, dim] is not tied to the
  output head, on an engine without tp: A [r, num_embeddings], B [dim, r] (`lora_embedding_A`,
  `lora_embedding_B`, no `.weight`); delta = scale * (B @ A).T, as peft's Embedding computes it.
  Tied, a merge would change the output head too, which the adapter does not train (peft keeps the
  head on the base weight); at tp > 1 the engine's vocab-sharded embedding is not served (not built).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class LoraTarget:
    module: str  # in-memory module path, e.g. model.layers.0.self_attn.q_proj
    lora_a: torch.Tensor  # [r, in_features]; an embedding's [r, num_embeddings]
    lora_b: torch.Tensor  # [out_features, r]; an embedding's [dim, r]
    scale: float
    embedding: bool = False  # an nn.Embedding target: the delta is (B @ A).T

    @property
    def keys(self) -> tuple[str, str]:
        """The peft keys of A and B."""
        return factor_keys(self.module, self.embedding)

    def delta(
        self,
        device: torch.device,
        lora_a: torch.Tensor | None = None,
        lora_b: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ):
        """The change of the weight, as a full float32 tensor of its shape: scale * B @ A (an embedding's:
        its transpose, a view), peft's get_delta_weight in float32. `lora_a`, `lora_b`: this target's
        halves where they were copied already (default: its own); `out`: a float32 tensor of the weight's
        size to write the product into (the same product: `mm` is `mm_out` into a new tensor)."""
        lora_a = self.lora_a if lora_a is None else lora_a
        lora_b = self.lora_b if lora_b is None else lora_b
        if out is not None and self.embedding:  # B @ A is [dim, num_embeddings]: the weight's transpose
            out = out.view(lora_b.shape[0], lora_a.shape[1])
        product = torch.matmul(lora_b.to(device, torch.float32), lora_a.to(device, torch.float32), out=out)
        product.mul_(self.scale)
        return product.T if self.embedding else product

    def halves(self) -> dict[str, torch.Tensor]:
        return {"A": self.lora_a, "B": self.lora_b}


def factor_keys(module: str, embedding: bool) -> tuple[str, str]:
    """peft's saved keys of a target's A and B (get_peft_model_state_dict, the adapter name dropped)."""
    prefix = f"base_model.model.{module}"
    if embedding:
        return f"{prefix}.lora_embedding_A", f"{prefix}.lora_embedding_B"
    return f"{prefix}.lora_A.weight", f"{prefix}.lora_B.weight"


def lora_targets(model: nn.Module, params: dict[str, torch.Tensor], tp_size: int = 1) -> dict[str, tuple[int, int]]:
    """Module path -> full weight shape of every module an adapter may target: each nn.Linear whose
    weight is one parameter of its own ([out, in]: not tied, not fused), and at tp_size 1 each
    nn.Embedding whose weight is ([num_embeddings, dim]: not tied to the output head)."""
    names_of: dict[int, int] = {}
    for param in params.values():
        names_of[id(param)] = names_of.get(id(param), 0) + 1
    kinds = (nn.Linear, nn.Embedding) if tp_size == 1 else (nn.Linear,)
    return {
        name: tuple(module.weight.shape)
        for name, module in model.named_modules()
        if isinstance(module, kinds) and names_of.get(id(module.weight)) == 1
    }


def why_not_targetable(model: nn.Module, module_path: str) -> str:
    try:
        module = model.get_submodule(module_path)
    except AttributeError:
        return "the model has no such module"
    kind = type(module).__name__
    if "expert" in module_path.split(".")[-1].lower() or "Experts" in kind:
        return (
            f"it is a fused MoE expert module ({kind}: one parameter holds every expert), which the embedded "
            "engine cannot target; target attention projections (q_proj, k_proj, v_proj, o_proj) or serve "
            "expert LoRA with SGLang"
        )
    if isinstance(module, nn.Linear):
        return "its weight is tied to another parameter (e.g. lm_head tied to the embeddings)"
    if isinstance(module, nn.Embedding) and _is_tied(model, module.weight):
        return (
            "its weight is tied to the output head (lm_head): merging the adapter would change the head too; "
            "drop it from the targets, or use a model with tie_word_embeddings=false"
        )
    if isinstance(module, nn.Embedding):  # untied, so not targetable for the engine's tp
        return (
            "an embedding target is served at tp 1 only (this engine runs tp > 1): train the adapter without "
            "it, or serve it with --tp-size 1"
        )
    return f"it is a {kind}, not an nn.Linear or nn.Embedding"


def is_embedding(model: nn.Module, module_path: str) -> bool:
    return isinstance(model.get_submodule(module_path), nn.Embedding)


def _is_tied(model: nn.Module, weight: torch.Tensor) -> bool:
    return sum(param is weight for _, param in model.named_parameters(remove_duplicate=False)) > 1
