"""Seeds of the engines' sampling (`sampling_params.sampling_seed`), so that a seeded run draws the
same samples again.

A request's seed is a pure function of the run's seed and of the request's place in the run, never
of the clock, the engine or the order in which requests arrive: `derive_seed(grpo.seed, position)`
for a prompt (its position in the run's prompt stream: step x prompts_per_step + its index in the
step, in the synchronous loop), `derive_seed(prompt's seed, sample, turn)` for a turn of an episode.
A request sent again (its engine died) is the same payload, so it carries the same seed.

How a seed reaches a request's n samples differs by backend; `seeded_payload` writes both forms:
- the embedded engine draws sample k of a seeded request from (seed, k) (engine/sequences/sampling.py
  `seed_key`), so a prompt stays one request with `n` and one seed;
- SGLang (0.5.23) gives every one of a request's n copies the same `sampling_seed`
  (`GenerateReqInput._normalize_sampling_params`), and its seeded draw is a function of (seed,
  position, token id) alone (`layers/sampler.py: multinomial_with_seed`): the copies of one prompt
  would draw the same tokens. A seeded SGLang request is therefore n copies of the prompt, each
  with n=1 and a seed of its own, `derive_seed(seed, k)` (SGLang's radix cache shares their prefix).
"""

from __future__ import annotations

import hashlib
from typing import Any


def derive_seed(*parts: int) -> int:
    """A seed in [0, 2**63) from integers (the run's seed first, then where the request sits): the
    same in every process and Python version, inside SGLang's signed 64-bit range."""
    digest = hashlib.blake2b(repr(tuple(int(p) for p in parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


def seeded_payload(payload: dict[str, Any], seed: int, *, each_sample: bool) -> dict[str, Any]:
    """One prompt's /generate payload (`input_ids`, `sampling_params` with `n`) with its samples drawn
    from `seed`: one seed for the request, or (`each_sample`, SGLang) n copies of the prompt with a
    seed each. Either way the engine answers the n samples in order."""
    params = payload["sampling_params"]
    if not each_sample:
        return {**payload, "sampling_params": {**params, "sampling_seed": seed}}
    n = params.get("n", 1)
    return {
        **payload,
        "input_ids": [payload["input_ids"]] * n,
        "sampling_params": [{**params, "n": 1, "sampling_seed": derive_seed(seed, k)} for k in range(n)],
    }
