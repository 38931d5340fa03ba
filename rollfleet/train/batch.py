"""A train step's batch: what it must hold (checked before any collective runs), and its micro-batches
as padded tensors."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from rollfleet.train.routing_replay import replay_routes

_REQUIRED = ("prompt_ids", "output_ids", "logprobs", "advantage")


def check_batch(batch: Sequence[Mapping[str, Any]]) -> None:
    if not batch:
        raise ValueError("train_step got an empty batch")
    for index, item in enumerate(batch):
        missing = [key for key in _REQUIRED if key not in item]
        if missing:
            raise ValueError(f"batch[{index}] lacks {missing} (each item needs {list(_REQUIRED)})")
        if len(item["logprobs"]) != len(item["output_ids"]):
            raise ValueError(
                f"batch[{index}] has {len(item['logprobs'])} logprobs for "
                f"{len(item['output_ids'])} output tokens (one engine logprob per output token)"
            )
        mask = item.get("loss_mask")
        if mask is not None and (len(mask) != len(item["output_ids"]) or set(mask) - {0, 1}):
            raise ValueError(
                f"batch[{index}] has a loss_mask of {len(mask)} entries for {len(item['output_ids'])} output "
                "tokens (one 0 or 1 per output token: 1 for the policy's tokens)"
            )
        if not item["prompt_ids"]:
            raise ValueError(f"batch[{index}] has no prompt tokens (the first output token needs a prompt)")


def trained_tokens(item: Mapping[str, Any]) -> int:
    """How many of an item's output tokens the loss covers: its policy tokens (loss_mask), else all."""
    mask = item.get("loss_mask")
    return len(item["output_ids"]) if mask is None else int(sum(mask))


def collate(items: Sequence[Mapping[str, Any] | None], pad_token_id: int, routes_shape=None) -> dict[str, torch.Tensor]:
    """Right-padded prompt+output ids; per-position tensors are aligned with logits[:, :-1]
    (position p predicts token p+1), masked to the output tokens (an item's `loss_mask`: to the
    policy's tokens among them, an episode's observations left out); on the CPU."""
    rows = [
        (list(it["prompt_ids"]), list(it["output_ids"]), list(it["logprobs"]), float(it["advantage"]))
        if it is not None
        else ([pad_token_id], [pad_token_id], [0.0], 0.0)
        for it in items
    ]
    width = max(len(p) + len(o) for p, o, _, _ in rows)
    input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros((len(rows), width - 1))
    old = torch.zeros((len(rows), width - 1))
    for row, ((prompt, output, logprobs, _), item) in enumerate(zip(rows, items, strict=True)):
        length = len(prompt) + len(output)
        input_ids[row, :length] = torch.tensor(prompt + output)
        attention[row, :length] = 1
        if item is not None and output:
            span = slice(len(prompt) - 1, length - 1)
            loss_mask = item.get("loss_mask")
            mask[row, span] = 1 if loss_mask is None else torch.tensor(loss_mask, dtype=torch.float32)
            old[row, span] = torch.tensor(logprobs, dtype=torch.float32)
    advantages = torch.tensor([adv for _, _, _, adv in rows])
    out = {
        "input_ids": input_ids,
        "attention_mask": attention,
        "mask": mask,
        "old_logprobs": old,
        "advantages": advantages,
    }
    if routes_shape is not None:  # routing replay: the engine's expert choices per position
        out["routes"] = replay_routes(items, width, routes_shape)
    return out
