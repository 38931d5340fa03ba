"""The trainer's log-probs of the chosen tokens without the whole float32 logits (`train.logprob_chunk`).

Why: the plain way builds rows x width x vocab logits and a float32 copy of them, and keeps them for
backward: 11 GB for one micro-batch of 32 x 576 tokens at Qwen3's 151,936-token vocabulary. Here the
model's output head is called on `chunk` positions at a time: its logits -> float32 -> / the sampling
temperature -> the chosen token's logit minus the log-sum-exp. Each chunk runs under activation
checkpointing, so backward recomputes one chunk's logits at a time as well: the peak grows with
chunk x vocab, not with rows x width x vocab. The values are today's formula, chunk by chunk.

How the head is reached (`ChunkedHead`), so that what held for the plain forward still holds: the
head is called as a module (a peft LoRA head adds its adapter, hooks run) from inside the model's own
forward, where FSDP2 has gathered the root's parameters (tied embeddings included); the log-probs
leave as the model's `logits` output, on which FSDP2 hooks its backward. A pre-hook on the head takes
its input (the final hidden states) and hands it an empty slice, so the head itself computes
nothing; a forward hook puts the log-probs in place of its output. A model that changes its logits
after the head (a softcap, a scale) would change the log-probs too: its output is then not the
head's tensor, and it is refused.

Why not torch.nn.functional.linear_cross_entropy (torch 2.13): it takes the head's weight tensor,
which skips a LoRA adapter on the head and FSDP2's hooks on the module.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.utils.checkpoint import checkpoint


def chunked_token_logprobs(
    head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, *, temperature: float = 1.0, chunk: int = 1024
) -> torch.Tensor:
    """log softmax(head(hidden) / temperature) at `targets`, float32, shape of `targets`.

    `hidden` [..., dim] and `targets` [...] (the same leading shape) are flattened and scored `chunk`
    positions at a time; with grad enabled each chunk's logits are recomputed in backward."""
    if chunk < 1:
        raise ValueError(f"chunk={chunk}: must be at least 1 position (fix: train.logprob_chunk >= 1)")
    flat, flat_targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    pieces = []
    for start in range(0, max(flat.shape[0], 1), chunk):  # no positions: one empty chunk, still in the graph
        part = (head, flat[start : start + chunk], flat_targets[start : start + chunk], temperature)
        if torch.is_grad_enabled():
            pieces.append(checkpoint(_chunk_logprobs, *part, use_reentrant=False))
        else:
            pieces.append(_chunk_logprobs(*part))
    return torch.cat(pieces).reshape(targets.shape)


def _chunk_logprobs(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, temperature: float):
    logits = head(hidden).float()
    if temperature != 1.0:
        logits = logits / temperature
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


class ChunkedHead:
    """Hooks on one causal LM's output head: inside `scoring(...)` a forward of the model returns, as
    its `logits`, log p(token p+1 | tokens <= p) [rows, width-1] (see the module docstring); outside,
    and for the head calls the scoring makes itself, the head is untouched."""

    def __init__(self, model: torch.nn.Module, chunk: int):
        self.head = model.get_output_embeddings()
        if self.head is None:
            raise ValueError(f"{type(model).__name__} names no output head (get_output_embeddings() is None)")
        self.chunk = chunk
        self._targets: torch.Tensor | None = None  # [rows, width-1] while scoring, until the head ran
        self._temperature = 1.0
        self._hidden: torch.Tensor | None = None
        self._result: torch.Tensor | None = None
        self.head.register_forward_pre_hook(self._take_hidden)
        self.head.register_forward_hook(self._score)

    @contextlib.contextmanager
    def scoring(self, input_ids: torch.Tensor, temperature: float) -> Iterator[None]:
        """The next forward of the model scores each next token of `input_ids` [rows, width]."""
        self._targets, self._temperature, self._result = input_ids[:, 1:], temperature, None
        try:
            yield
        finally:
            self._targets = self._hidden = None

    def logprobs(self, output) -> torch.Tensor:
        """The log-probs a forward inside `scoring` returned as its `logits` (refused if the model changed them)."""
        result, self._result = self._result, None
        if result is None or output.logits is not result:
            raise ValueError(
                f"{type(self.head).__name__} head: the model's logits are not its output head's tensor (it "
                "transforms them after the head, e.g. a final logit softcap or scale), so the trainer's "
                "chunked log-probs would not be the model's (fix: train a model whose logits are its head's output)"
            )
        return result

    def _take_hidden(self, _module, args):
        if self._targets is None:
            return None
        self._hidden = args[0]
        return (args[0][:, :0], *args[1:])  # the head computes nothing; `_score` does, in chunks

    def _score(self, module, _args, _output):
        if self._hidden is None:
            return None
        hidden, targets = self._hidden[:, :-1], self._targets
        self._hidden = self._targets = None  # the head calls below (and their recompute) pass straight through
        logprobs = chunked_token_logprobs(module, hidden, targets, temperature=self._temperature, chunk=self.chunk)
        # a tensor of its own, not a view: FSDP2 hooks the model's output for backward (an in-place op
        # on a view would drop the hook); rows x width floats
        self._result = logprobs.clone()
        return self._result
