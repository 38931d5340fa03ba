"""The KV pool on one tp rank's device: per attention layer a key and a value tensor of
`[num_pages * page_size, local kv heads, head_dim]` token slots, allocated once, released and
resumed with the `kv_cache` memory tag. `epoch` counts releases and resumes: KV written before a
change is gone (the scheduler's pages and prefix cache start over, kv/steps.py).

Two ways to release (chosen once at start, kv/saver.py): with the memory saver the pages are
unmapped and mapped again at the same addresses (milliseconds; CUDA graphs over the pool stay
valid); without it each storage is resized to 0 and back, and zeroed (new addresses: graphs are
dropped, kv/paged.py). The saver's resume does not zero (that would be a pass over the whole pool
on every turn): stale or arbitrary slot contents (NaN bit patterns included) are never used. A slot
is written before any step reads it as a key below a row's length (a new epoch hands out pages
afresh and its running sequences recompute), and the slots a step reads past a row's length (the
rest of its last page, padding pages) are masked: the decode kernel does not load them, and the
gather path zeroes them (kv/attention.py)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from rollfleet.engine.kv.saver import KV_CACHE_TAG, PausableMemory

DEFAULT_PAGE_SIZE = 16


@dataclass(frozen=True)
class KVShape:
    num_layers: int
    kv_heads: int  # on this rank
    head_dim: int
    dtype: torch.dtype

    @classmethod
    def of(cls, config, dtype: torch.dtype, tp_size: int) -> KVShape:
        text = config.get_text_config()
        heads = text.num_key_value_heads or text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        return cls(text.num_hidden_layers, max(heads // tp_size, 1), head_dim, dtype)

    @property
    def bytes_per_token(self) -> int:
        return self.num_layers * 2 * self.kv_heads * self.head_dim * self.dtype.itemsize


class KVPool:
    def __init__(
        self, shape: KVShape, num_pages: int, page_size: int, device: torch.device, saver: PausableMemory | None = None
    ):
        self.shape, self.num_pages, self.page_size, self.device = shape, num_pages, page_size, device
        self.saver = saver
        slots = num_pages * page_size
        with saver.region(KV_CACHE_TAG) if saver is not None else contextlib.nullcontext():
            self.keys = [self._zeros(slots) for _ in range(shape.num_layers)]
            self.values = [self._zeros(slots) for _ in range(shape.num_layers)]
        self.epoch = 0
        self.released = False

    def _zeros(self, slots: int) -> torch.Tensor:
        return torch.zeros(slots, self.shape.kv_heads, self.shape.head_dim, dtype=self.shape.dtype, device=self.device)

    @property
    def nbytes(self) -> int:
        return 0 if self.released else self.full_bytes()

    def full_bytes(self) -> int:
        """The pool's bytes when held (released or not)."""
        return sum(t.numel() * t.element_size() for t in [*self.keys, *self.values])

    def copy_pages(self, pairs: list[tuple[int, int]]) -> None:
        """Page `dst` gets page `src`'s KV in every layer (a fork's partial last page)."""
        if not pairs:
            return
        size = self.page_size
        offsets = torch.arange(size)
        src = torch.tensor([s for s, _ in pairs])[:, None] * size + offsets
        dst = torch.tensor([d for _, d in pairs])[:, None] * size + offsets
        src, dst = src.flatten().to(self.device), dst.flatten().to(self.device)
        for tensor in [*self.keys, *self.values]:
            tensor.index_copy_(0, dst, tensor.index_select(0, src))

    def release(self) -> None:
        if self.released:  # a release of all tags while the KV cache is released already
            return
        if self.saver is not None:
            self.saver.pause(KV_CACHE_TAG, self.device)
        else:
            for tensor in [*self.keys, *self.values]:
                tensor.untyped_storage().resize_(0)
        self.released, self.epoch = True, self.epoch + 1

    def resume(self) -> None:
        if not self.released:
            return
        if self.saver is not None:
            self.saver.resume(KV_CACHE_TAG)
        else:
            for tensor in [*self.keys, *self.values]:  # fresh storage: zeroed, as before the saver
                tensor.untyped_storage().resize_(tensor.numel() * tensor.element_size())
                tensor.zero_()
        self.released, self.epoch = False, self.epoch + 1


def pool_tokens(
    shape: KVShape,
    device: torch.device,
    *,
    max_total_tokens: int | None,
    mem_fraction: float,
    max_running: int,
    context_length: int,
    reserve_bytes: int = 0,
) -> int:
    """How many token slots the pool gets: `--max-total-tokens` when given; on a GPU what fits in
    `mem_fraction` of the device after what is allocated (weights) and `reserve_bytes` (activations,
    logits, graphs); on the CPU room for `max_running` sequences of up to 4096 tokens."""
    if max_total_tokens is not None:
        return max_total_tokens
    if device.type != "cuda":
        return max_running * min(context_length, 4096)
    _, total = torch.cuda.mem_get_info(device)
    budget = total * mem_fraction - torch.cuda.memory_allocated(device) - reserve_bytes
    tokens = int(budget // shape.bytes_per_token)
    if tokens < 1024:
        raise RuntimeError(
            f"the KV pool would hold {tokens} tokens: --mem-fraction-static {mem_fraction} leaves "
            f"{budget / 2**30:.1f} GiB after the weights; raise it, or give --max-total-tokens"
        )
    return tokens
