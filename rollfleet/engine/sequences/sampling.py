"""One step's next tokens and their logprobs, for the whole batch at once, on the model's device.

The step's logits (`[rows, vocab]`) never leave the device: what crosses to the host is, per row,
the sampled token id and its logprob, and only where a request asked for them the top-k logprobs
(`top_logprobs_num`) and the logprobs of chosen ids (`token_ids_logprob`): kilobytes a step, not
rows x vocab x 4 bytes. `Sampled.host_bytes` counts what crossed (the engine's `host_bytes` stat).

As SGLang 0.5.23 samples (`srt/layers/sampler.py`):
- temperature below 1e-6 is greedy: the argmax of the raw logits;
- otherwise softmax(logits / temperature), with top-k (the k most likely), top-p (the fewest most
  likely tokens whose mass reaches top_p) and min-p (tokens of at least min_p x the largest
  probability) applied together to that distribution; the token is drawn from what they keep;
- `min_new_tokens`: the stop tokens are banned (logit -inf) until that many tokens are out, before
  anything else, so the logprobs see the ban too;
- logprobs (the sampled token's, top-k and chosen ids) are log_softmax(logits / temperature), the
  distribution before top-k / top-p / min-p, and of the raw logits for a greedy row; -inf is
  clamped to float32's lowest value (JSON has no -inf).

Draws are Gumbel-max (argmax of the kept scaled logits plus Gumbel noise: an exact draw from their
softmax). A seeded sample's noise is a counter-based hash of (its seed, its sample index, the output
position, the token id), so the same seed and weights give the same tokens whatever shares the
batch, whatever the device, and after a retract or a recompute; unseeded rows draw their noise
from one generator on the device.

Where the fused kernel runs (sample_kernel.py, CUDA), a step's plain rows go through it and the
others through the general path here, each a pass of its own (`Joined`): a row's token and logprob
are the same bits whatever its neighbours ask (the two paths round a logprob differently, ~1e-6).
"""

from __future__ import annotations

import functools
import operator
import secrets
from collections.abc import Sequence as Seq
from typing import NamedTuple

import torch

from rollfleet.engine.sequences import sample_kernel
from rollfleet.engine.sequences.device_copy import to_device
from rollfleet.engine.sequences.draws import Drawn, Joined, Sampled
from rollfleet.wire.protocol import SamplingParams

MASK32 = 0xFFFFFFFF
LOWEST = torch.finfo(torch.float32).min


def seed_key(params: SamplingParams, sample_index: int) -> int | None:
    """The noise key of sample `sample_index` of a request (None: unseeded, the device generator's)."""
    if params.sampling_seed is None:
        return None
    return _mix64((params.sampling_seed * 1_000_003 + sample_index) % 2**64)


def _mix64(x: int) -> int:
    """splitmix64's finalizer on a Python int (host side: one per row per step)."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 % 2**64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB % 2**64
    return x ^ (x >> 31)


def step_key(key: int, position: int) -> int:
    """The 32-bit noise key of one output position of a seeded sample."""
    return _mix64((key + position * 0x9E3779B97F4A7C15) % 2**64) & MASK32


def _fmix(x: torch.Tensor, constant: int, shift: int) -> torch.Tensor:
    """One multiply-xorshift round on int64 values below 2**32: every product stays below 2**63
    (constants below 2**31), so the hash is the same on every device and never overflows."""
    x = (x * constant) & MASK32
    return x ^ (x >> shift)


def hashed_uniform(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """`[rows, vocab]` uniforms in (0, 1), a function of each row's 32-bit key and the token id only."""
    ids = torch.arange(vocab, device=keys.device, dtype=torch.int64)
    x = keys[:, None] ^ ((ids * 0x61C88647) & MASK32)[None, :]
    x = x ^ (x >> 16)
    for constant, shift in ((0x7FEB352D, 15), (0x5BD1E995, 13), (0x2C1B3C6D, 16)):
        x = _fmix(x, constant, shift)
    return ((x >> 8).to(torch.float32) + 0.5) / 2**24  # 24 bits: exact in float32, never 0 or 1


class SampleRow(NamedTuple):
    """What the sampler needs of one running sample this step (a tuple: one is made per row per
    step, and a frozen dataclass costs several times as much to build)."""

    params: SamplingParams
    key: int | None  # seed_key, None when unseeded
    position: int  # output tokens so far: the index of the token drawn now
    banned: frozenset[int] = frozenset()  # stop ids banned this step (min_new_tokens not reached)
    top_n: int = 0
    token_ids: tuple[int, ...] | None = None
    wants_logprob: bool = True


def _assemble(rows: Seq[SampleRow], asked: list[int], host: dict[str, list], nbytes: int, every=False) -> Sampled:
    """The step's `Sampled` from the host's lists: `values` holds the logprobs of the rows `asked`
    (of every row when `every`), `top_*` and `chosen` those of the rows that asked them."""
    if len(asked) == len(rows):  # every row asked (in order): the values as they are
        logprobs: list[float | None] = list(host["values"])
    else:
        logprobs = [None] * len(rows)
        for j, i in enumerate(asked):
            logprobs[i] = host["values"][i if every else j]
    top: list[list[tuple[float, int]] | None] = [None] * len(rows)
    for j, i in enumerate(i for i, r in enumerate(rows) if r.top_n > 0) if "top_values" in host else ():
        values, ids = host["top_values"][j], host["top_ids"][j]
        n = min(rows[i].top_n, len(values))
        top[i] = list(zip(values[:n], ids[:n]))
    chosen: list[list[tuple[float, int]] | None] = [None] * len(rows)
    for j, i in enumerate(i for i, r in enumerate(rows) if r.token_ids is not None):
        ids = rows[i].token_ids
        chosen[i] = list(zip(host["chosen"][j][: len(ids)], ids)) if ids else []
    return Sampled(host["tokens"], logprobs, top, chosen, nbytes)


class Sampler:
    """Samples the steps of one engine (rank 0's scheduler); owns the unseeded rows' generator."""

    def __init__(self, seed: int | None = None, fused: bool | None = None):
        """`seed`: of the unseeded rows' generator (default: a fresh random one). `fused`: whether
        plain rows take the fused kernel (default: where it runs natively, CUDA with Triton; True
        under Triton's interpreter on the CPU, for tests)."""
        self._seed = secrets.randbits(63) if seed is None else seed
        self._generators: dict[torch.device, torch.Generator] = {}
        self._fuses = fused
        self._last: _Known | None = None  # the last fused step's rows' params and what they give the kernel

    def _generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = torch.Generator(device).manual_seed(self._seed)
        return self._generators[device]

    def sample(self, logits: torch.Tensor, rows: Seq[SampleRow]) -> Sampled:
        """The next token of every row of `logits` ([rows, vocab], on the device)."""
        return self.launch(logits, rows).collect()

    @torch.inference_mode()
    def launch(self, logits: torch.Tensor, rows: Seq[SampleRow]) -> Drawn | Joined:
        """The draws of every row of `logits`, queued on the device: nothing waits for the device here."""
        assert logits.shape[0] == len(rows), (logits.shape, len(rows))
        fuses = sample_kernel.available(logits.device) if self._fuses is None else self._fuses
        if not fuses:
            return self._general(logits, rows)
        known = self._known(rows, logits.shape[1], logits.device)
        plain = [i for i, (ok, r) in enumerate(zip(known.plain, rows)) if ok and not r.top_n and r.token_ids is None]
        if len(plain) == len(rows):
            return self._fused(logits, rows, known)
        if plain:  # plain rows fused, the rest general: a row's draw and logprob never depend on its neighbours'
            rest = sorted(set(range(len(rows))) - set(plain))
            some, at = [rows[i] for i in plain], _at(plain, logits.device)
            fused = self._fused(logits[at], some, _Known.of(some, logits.shape[1], logits.device))
            general = self._general(logits[_at(rest, logits.device)], [rows[i] for i in rest])
            return Joined(len(rows), [(plain, fused), (rest, general)])
        return self._general(logits, rows)

    def _known(self, rows: Seq[SampleRow], vocab: int, device: torch.device) -> _Known:
        """What the fused kernel needs of the rows' params, kept while a step's rows have the same
        params objects as the last step's (a steady decode: no per-row lists, no copies to the device)."""
        last, params = self._last, [r.params for r in rows]
        if last is None or last.vocab != vocab or last.device != device or not same_objects(params, last.params):
            self._last = last = _Known.of(rows, vocab, device)
        return last

    def _general(self, logits: torch.Tensor, rows: Seq[SampleRow]) -> Drawn:
        """Any rows (top-k, top-p, min-p, top-k or chosen-id logprobs), in passes of torch ops."""
        # each pass over [rows, vocab] float32 costs ~0.15 ms at 512 x 151,936 on an H200: none is made
        # that no row needs (no argmax without a greedy row, no division at temperature 1, no copy
        # of all rows, no full log_softmax unless a row asks top-k or chosen-id logprobs)
        logits = _ban(logits.float(), rows)
        drawn = [i for i, r in enumerate(rows) if not r.params.is_greedy]
        scaled = logits
        if any(r.params.temperature != 1.0 for r in rows if not r.params.is_greedy):
            temperature = [1.0 if r.params.is_greedy else r.params.temperature for r in rows]
            scaled = logits / _column(temperature, logits.device)
        if len(drawn) == len(rows):
            tokens = self._draw(scaled, rows, drawn)
        else:
            tokens = torch.argmax(logits, dim=-1)
            if drawn:
                tokens[_at(drawn, tokens.device)] = self._draw(scaled, rows, drawn)
        parts = {"tokens": tokens}
        wants_full = [bool(r.top_n or r.token_ids is not None) for r in rows]
        full = any(wants_full)
        logprobs = torch.log_softmax(scaled, dim=-1).clamp_(min=LOWEST) if full else None
        asked = [i for i, r in enumerate(rows) if r.wants_logprob]
        if asked:
            # log_softmax at the chosen token only (one read of the rows, nothing written), except
            # for a row that asked the full one: a row's logprob never depends on what its
            # neighbours asked (the two round differently)
            index = _at(asked, logits.device)
            if all(wants_full[i] for i in asked):
                parts["values"] = logprobs[index, tokens[index]]
            else:
                picked = scaled[index] if len(asked) != len(rows) else scaled
                values = picked.gather(1, tokens[index][:, None])[:, 0] - picked.logsumexp(dim=-1)
                values = values.clamp_(min=LOWEST)
                if full:
                    own = to_device([wants_full[i] for i in asked], torch.bool, logits.device)
                    values = torch.where(own, logprobs[index, tokens[index]], values)
                parts["values"] = values
        if full:
            parts.update(_top(logprobs, rows), **_chosen(logprobs, rows))
        return Drawn(tokens, parts, functools.partial(_assemble, rows, asked))

    def _fused(self, logits: torch.Tensor, rows: Seq[SampleRow], known: _Known) -> Drawn:
        """Every row plain (greedy or temperature alone, seeded or not; no top-k or chosen ids): the
        token and its logprob in one pass (sample_kernel.py)."""
        seed = int(torch.randint(2**31 - 1, (1,), generator=self._generator(torch.device("cpu"))))
        keys = None  # seeded rows: their step keys (the general path's hashed noise, in the kernel)
        if any(r.key is not None for r in rows):
            keys = [-1 if r.key is None else step_key(r.key, r.position) for r in rows]
            keys = to_device(keys, torch.int64, logits.device)
        tokens, values = sample_kernel.fused_sample(_ban(logits, rows), known.inverse, known.greedy, seed, keys)
        asked = [i for i, r in enumerate(rows) if r.wants_logprob]
        parts = {"tokens": tokens, "values": values} if asked else {"tokens": tokens}
        return Drawn(tokens, parts, functools.partial(_assemble, rows, asked, every=True))

    def _draw(self, scaled: torch.Tensor, rows: Seq[SampleRow], drawn: list[int]) -> torch.Tensor:
        """Gumbel-max draws for the non-greedy rows `drawn` of the temperature-scaled logits."""
        picked = scaled[_at(drawn, scaled.device)] if len(drawn) != scaled.shape[0] else scaled
        kept = _filter(picked, [rows[i].params for i in drawn])
        seeded = [j for j, i in enumerate(drawn) if rows[i].key is not None]
        unseeded = [j for j, i in enumerate(drawn) if rows[i].key is None]
        generator = self._generator(kept.device)
        if not seeded:  # the common case: one draw into the noise itself
            noise = torch.empty_like(kept).exponential_(generator=generator)
        else:
            noise = torch.empty_like(kept)
            if unseeded:
                own = torch.empty((len(unseeded), kept.shape[1]), device=kept.device).exponential_(generator=generator)
                noise[_at(unseeded, kept.device)] = own
            keys = [step_key(rows[drawn[j]].key, rows[drawn[j]].position) for j in seeded]
            uniform = hashed_uniform(to_device(keys, torch.int64, kept.device), kept.shape[1])
            noise[_at(seeded, kept.device)] = -torch.log(uniform)  # Exp(1)
        noise.clamp_(min=torch.finfo(torch.float32).tiny).log_()  # an exact 0 would make its token certain
        return torch.argmax(kept - noise, dim=-1)  # -log(Exp(1)) is Gumbel(0, 1)


class _Known(NamedTuple):
    """Per-row facts of a step's params for the fused kernel (`Sampler._known`)."""

    params: list[SamplingParams]  # held: the identity check needs them alive
    vocab: int
    device: torch.device
    plain: list[bool]  # whether each row's params sample plainly (greedy or temperature alone)
    inverse: torch.Tensor  # 1 / temperature (1 for greedy rows), on the device
    greedy: torch.Tensor

    @staticmethod
    def of(rows: Seq[SampleRow], vocab: int, device: torch.device) -> _Known:
        params = [r.params for r in rows]
        return _Known(
            params,
            vocab,
            device,
            [p.is_greedy or not filters(p, vocab) for p in params],
            to_device([1.0 if p.is_greedy else 1.0 / p.temperature for p in params], torch.float32, device),
            to_device([p.is_greedy for p in params], torch.bool, device),
        )


def same_objects(a: list, b: list) -> bool:
    """Whether `a` and `b` hold the same objects in the same order (a steady step's rows, kv/overlap.py)."""
    return len(a) == len(b) and all(map(operator.is_, a, b))


def _ban(logits: torch.Tensor, rows: Seq[SampleRow]) -> torch.Tensor:
    pairs = [(i, token) for i, r in enumerate(rows) for token in r.banned if token < logits.shape[1]]
    if pairs:
        index = to_device(pairs, torch.long, logits.device)
        logits = logits.clone()  # the model's own logits stay as they are
        logits[index[:, 0], index[:, 1]] = float("-inf")
    return logits


def filters(params: SamplingParams, vocab: int) -> bool:
    return 0 < params.top_k < vocab or params.top_p < 1.0 or params.min_p > 0.0


def _filter(scaled: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """`scaled` with -inf where top-k, top-p or min-p drop a token; only the rows that filter are
    sorted (a plain temperature row costs nothing here)."""
    vocab = scaled.shape[1]
    rows = [i for i, p in enumerate(params) if filters(p, vocab)]
    if not rows:
        return scaled
    at = _at(rows, scaled.device)

    top_k = _column([p.top_k if 0 < p.top_k < vocab else vocab for p in (params[i] for i in rows)], scaled.device)
    top_p = _column([params[i].top_p for i in rows], scaled.device)
    min_p = _column([params[i].min_p for i in rows], scaled.device)
    probs, order = torch.softmax(scaled[at], dim=-1).sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=scaled.device, dtype=torch.float32)[None, :]
    drop = (rank >= top_k) | ((probs.cumsum(dim=-1) - probs) >= top_p) | (probs < min_p * probs[:, :1])
    drop[:, 0] = False  # the most likely token always stays
    dropped = torch.zeros_like(drop).scatter_(1, order, drop)
    scaled = scaled.clone()
    scaled[at] = scaled[at].masked_fill(dropped, float("-inf"))
    return scaled


def _top(logprobs: torch.Tensor, rows: Seq[SampleRow]) -> dict[str, torch.Tensor]:
    """The top-k logprobs and ids of the rows that asked them, k the largest asked (`_assemble` cuts)."""
    asked = [i for i, r in enumerate(rows) if r.top_n > 0]
    if not asked:
        return {}
    k = min(max(rows[i].top_n for i in asked), logprobs.shape[1])
    values, ids = torch.topk(logprobs[_at(asked, logprobs.device)], k, dim=-1)
    return {"top_values": values, "top_ids": ids}


def _chosen(logprobs: torch.Tensor, rows: Seq[SampleRow]) -> dict[str, torch.Tensor]:
    """The logprobs of the chosen ids of the rows that asked them (padded to the longest ask)."""
    asked = [i for i, r in enumerate(rows) if r.token_ids is not None]
    width = max((len(rows[i].token_ids) for i in asked), default=0)
    if width == 0:
        return {}
    padded = [list(rows[i].token_ids) + [0] * (width - len(rows[i].token_ids)) for i in asked]
    return {"chosen": logprobs[_at(asked, logprobs.device)].gather(1, _at(padded, logprobs.device))}


def _at(indices: list, device: torch.device) -> torch.Tensor:
    """An index on the device (a Python list as an index of a CUDA tensor is copied over synchronously,
    which would make the host wait for the step it is sampling)."""
    return to_device(indices, torch.long, device)


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    """One value per row, as a `[rows, 1]` float32 column on `device` (broadcasts over the vocabulary)."""
    return to_device(values, torch.float32, device)[:, None]
