"""The generate request of the SGLang HTTP protocol: `/generate`'s request, its sampling params and
an answer's finish reason; the one source of truth for their field names and defaults, shared by the
embedded server and the client. The control routes' requests are control_requests.py's, the fields
every request shares request_fields.py's.

Only the subset rollfleet serves is modelled (see docs/architecture.md). Unknown fields are
ignored, as SGLang does, so a client built for a newer SGLang still talks to this server.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from rollfleet.wire.request_fields import Lenient, as_float32, null_is_default, utf8_texts

GREEDY_TEMPERATURE = 1e-6  # SGLang: a temperature below this means argmax
SEED_RANGE = (-(2**63), 2**63 - 1)  # SGLang's sampling_seed range
MAX_TOP_LOGPROBS = 1024  # most logprobs per position one request may ask for (top-k or listed token ids)
MAX_STOP_STRINGS = 32  # SGLang's MAX_STOP_COUNT


class SamplingParams(Lenient):
    """SGLang's sampling fields and ranges (its `SamplingParams.verify`), checked as the engine's
    float32 tensors will see them. Token ids are checked against the vocabulary by the server, and
    `n` against its --max-samples-per-request."""

    max_new_tokens: int | None = Field(128, ge=0)  # None: up to the context length (SGLang's null)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = -1
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    n: int = Field(1, ge=1)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    sampling_seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    min_new_tokens: int = Field(0, ge=0)
    # SGLang's ranges; the embedded engine applies no penalty and refuses a value that is not neutral
    # (rollfleet.engine.runtime.admission.NEUTRAL_PENALTIES): only the defaults reach here
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=2.0)
    no_stop_trim: bool = False  # keep the matched stop string (or stop token's text) in `text`

    _stop_is_utf8 = field_validator("stop")(utf8_texts)

    @model_validator(mode="before")
    @classmethod
    def _nulls(cls, fields: Any) -> Any:
        fields = null_is_default(fields, ("max_new_tokens",))
        if isinstance(fields, dict) and isinstance(fields.get("stop_token_ids"), list):  # SGLang drops null ids
            fields["stop_token_ids"] = [t for t in fields["stop_token_ids"] if t is not None]
        return fields

    @field_validator("temperature")
    @classmethod
    def _temperature_fits_float32(cls, value: float) -> float:
        if math.isinf(as_float32(value)):
            raise ValueError(
                f"temperature={value!r} overflows float32: use a value up to 1e38 (0 = greedy, 1 = the model's own)"
            )
        return value

    @field_validator("top_p")
    @classmethod
    def _top_p_fits_float32(cls, value: float) -> float:
        if as_float32(value) == 0.0:
            raise ValueError(
                f"top_p={value!r} is 0 in float32 (it would drop every token): use a value in [1e-38, 1] "
                "(1 = no nucleus cut)"
            )
        return value

    @model_validator(mode="after")
    def _check(self) -> SamplingParams:
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k={self.top_k}: use -1 (all tokens) or a positive number")
        if self.max_new_tokens is not None and self.min_new_tokens > self.max_new_tokens:  # SGLang's rule
            raise ValueError(
                f"min_new_tokens={self.min_new_tokens} is more than max_new_tokens={self.max_new_tokens}: "
                "give at most max_new_tokens"
            )
        if len(self.stop_strings) > MAX_STOP_STRINGS:  # SGLang's MAX_STOP_COUNT; each is searched every token
            raise ValueError(
                f"stop holds {len(self.stop_strings)} strings, at most {MAX_STOP_STRINGS} are allowed (as in SGLang): "
                "keep the ones that matter, or stop on token ids (stop_token_ids)"
            )
        return self

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


class GenerateRequest(Lenient):
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    return_logprob: bool = False
    # -1: output logprobs only; k >= 0: also the prompt's tokens from position k (input_token_logprobs)
    logprob_start_len: int = Field(-1, ge=-1)
    top_logprobs_num: int = Field(0, ge=0, le=MAX_TOP_LOGPROBS)
    token_ids_logprob: list[int] | None = Field(None, max_length=MAX_TOP_LOGPROBS)
    return_text_in_logprobs: bool = False
    stream: bool = False
    rid: str | list[str] | None = None
    lora_path: str | list[str | None] | None = None  # LoRA adapter name; a list: one per prompt
    # meta_info.routed_experts (rollfleet.wire.routed_experts), positions [routed_experts_start_len, seqlen - 1)
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    # rollfleet extension (the embedded engine says `rollfleet_logprob_values` in /get_server_info; never
    # sent to SGLang, whose /generate refuses unknown fields): the output tokens' logprobs as ONE list,
    # meta_info.output_token_logprob_values, instead of output_token_logprobs' [logprob, id, None]
    # triples (the ids are output_ids): a client reads 512 x 256 of them as 512 lists, not 131,072
    return_logprob_values: bool = False

    _texts_are_utf8 = field_validator("text", "rid", "lora_path")(utf8_texts)

    @model_validator(mode="before")
    @classmethod
    def _nulls(cls, fields: Any) -> Any:
        return null_is_default(fields)  # return_logprob: null -> False, logprob_start_len: null -> -1, ...

    @model_validator(mode="after")
    def _one_prompt_field(self) -> GenerateRequest:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of 'text' or 'input_ids'")
        if not self.token_ids_logprob:  # SGLang: [] means none
            self.token_ids_logprob = None
        return self


class FinishReason(BaseModel):
    type: Literal["stop", "length", "abort"]
    matched: int | str | None = None
    length: int | None = None
    message: str | None = None

    def to_wire(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True)
