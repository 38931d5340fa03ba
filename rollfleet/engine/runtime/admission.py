"""What a /generate request must satisfy before it is queued, beyond its schema: penalties at
their neutral values (none is applied here), every token id
inside the model's vocabulary (outside it would fail inside the model, failing the whole batch),
no more samples than the server takes per request (`--max-samples-per-request`), a token left to
sample, and none of SGLang's fields this engine cannot honour (`unserved`)."""

from __future__ import annotations

from typing import Any

from rollfleet.wire.protocol import SamplingParams

# SGLang's fields that change what is generated, which this engine cannot do: accepting them would
# answer as if they held (an unconstrained text where a JSON object was asked for)
UNSERVED = {
    "regex": "constrained decoding (SGLang's grammar backends)",
    "json_schema": "constrained decoding (SGLang's grammar backends)",
    "ebnf": "constrained decoding (SGLang's grammar backends)",
    "structural_tag": "constrained decoding (SGLang's grammar backends)",
    "stop_regex": "regular-expression stops",
    "logit_bias": "logit bias",
    "beam_width": "beam search",
    "custom_logit_processor": "custom logit processors",
}

# accepted at their neutral values (clients written for SGLang send them), refused otherwise
NEUTRAL_PENALTIES = {"frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0}


def check_request(
    prompts: list[list[int]],
    params: list[SamplingParams],
    field: str,
    *,
    vocab_size: int,
    max_samples: int,
    eos_token_ids: frozenset[int] = frozenset(),
) -> None:
    """ValueError naming the field, the value and the fix. `params` holds one entry per prompt;
    `field` names the prompts ("text" or "input_ids")."""
    total = sum(p.n for p in params)
    if total > max_samples:
        counts = sorted({p.n for p in params})
        raise ValueError(
            f"sampling_params.n={counts[0] if len(counts) == 1 else counts} for {len(prompts)} prompts asks for "
            f"{total} samples; this server takes at most {max_samples} per request "
            "(--max-samples-per-request): split the request or lower n"
        )
    vocab = f"outside this model's vocabulary [0, {vocab_size})"
    for index, prompt in enumerate(prompts):
        if prompt and (min(prompt) < 0 or max(prompt) >= vocab_size):
            position, token = next((i, t) for i, t in enumerate(prompt) if not 0 <= t < vocab_size)
            where = f"{field}[{index}][{position}]" if len(prompts) > 1 else f"{field}[{position}]"
            raise ValueError(f"{where}={token} is {vocab}: send token ids of this model's tokenizer")
    for index, p in enumerate(params):
        where = "sampling_params" if len(params) == 1 else f"sampling_params[{index}]"
        for key, neutral in NEUTRAL_PENALTIES.items():
            if getattr(p, key) != neutral:
                raise ValueError(
                    f"{where}.{key}={getattr(p, key)!r}: the embedded engine applies no penalties; send "
                    f"{key}={neutral:g} (or leave it out), or serve with SGLang (rollout.backend=sglang)"
                )
        bad = [t for t in p.stop_token_ids or [] if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"{where}.stop_token_ids holds {bad[:5]}, {vocab}: drop them")
        stops = set(p.stop_token_ids or []) | (set() if p.ignore_eos else set(eos_token_ids))
        if p.min_new_tokens > 0 and len(stops) >= vocab_size:  # in range, checked above
            # every token is masked before min_new_tokens: sampling would fail the whole batch, others' too
            raise ValueError(
                f"{where}.stop_token_ids (with the EOS tokens{'' if p.ignore_eos else ', ignore_eos=false'}) hold "
                f"every one of the vocabulary's {vocab_size} tokens, and min_new_tokens={p.min_new_tokens} forbids "
                "them all: no token is left to sample; drop some stop_token_ids or min_new_tokens"
            )


def unserved(fields: dict[str, Any], where: str = "") -> str | None:
    """Why `fields` (a sampling_params dict, or an OpenAI request) ask for what this engine cannot do;
    None when they do not. Empty values mean unset, as in SGLang."""
    for key, what in UNSERVED.items():
        if fields.get(key) not in (None, "", {}, []):
            return (
                f"{where}{key}={fields[key]!r:.80}: the embedded engine has no {what}; drop {key}, "
                "or serve with SGLang (rollout.backend=sglang)"
            )
    response_format = fields.get("response_format")
    kind = response_format.get("type") if isinstance(response_format, dict) else response_format
    if kind not in (None, "text"):
        return (
            f"response_format.type={kind!r}: the embedded engine has no constrained decoding; "
            "drop response_format (or use type 'text'), or serve with SGLang (rollout.backend=sglang)"
        )
    return None
