"""Request and response models of the SGLang HTTP protocol: the one source of truth for field
names and defaults, shared by the embedded server and the client.

Only the subset rollfleet serves is modelled (see docs/architecture.md). Unknown fields are
ignored, as SGLang does, so a client built for a newer SGLang still talks to this server.
"""

from __future__ import annotations

import math
import re
import struct
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from rollfleet.wire.remote_instance import parse_ports

GREEDY_TEMPERATURE = 1e-6  # SGLang: a temperature below this means argmax
SEED_RANGE = (-(2**63), 2**63 - 1)  # SGLang's sampling_seed range
MAX_TIMEOUT_S = 86400.0  # one day: longer waits are a mistake, and timedelta overflows on absurd ones
MAX_TOP_LOGPROBS = 1024  # most logprobs per position one request may ask for (top-k or listed token ids)
MAX_STOP_STRINGS = 32  # SGLang's MAX_STOP_COUNT
MAX_TENSOR_BYTES = 2**62  # a shape whose numel * 8 bytes goes past this cannot be allocated anywhere


def _utf8(value: str) -> str:
    """Text must encode as UTF-8: a lone surrogate ("\\ud800", legal in JSON) would fail the first
    time the server tokenizes, logs or answers with it, possibly long after this request."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"{value[max(0, exc.start - 20) : exc.end + 20]!r} has an unpaired surrogate at index {exc.start}, "
            "which UTF-8 cannot encode: send valid Unicode text"
        ) from None
    return value


Utf8Str = Annotated[str, AfterValidator(_utf8)]


_HOST = re.compile(r"[A-Za-z0-9._-]+|\[[0-9A-Fa-f:.]+\]")


def _host(value: str) -> str:
    """An address that goes into `tcp://HOST:PORT`: anything else breaks torch's rendezvous URL ("" or
    "x?rank=3" fail its asserts, outside the errors a failed join raises)."""
    if not _HOST.fullmatch(value):
        raise ValueError(
            f"{value!r} is not a host name or an IP address: give the address of group rank 0's host "
            "(an IPv6 address in brackets, as [::1])"
        )
    return value


HostStr = Annotated[str, AfterValidator(_host)]


def _utf8_texts(value: Any) -> Any:
    """`_utf8` on a str or on each str of a list (fields typed `str | list[str]`: one error, not one per branch)."""
    for item in [value] if isinstance(value, str) else value if isinstance(value, list) else []:
        if isinstance(item, str):
            _utf8(item)
    return value


def _float32(value: float) -> float:
    """`value` as the engine's float32 tensors see it (0.0 for values too small, inf for too large)."""
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        return math.copysign(math.inf, value)


class _Lenient(BaseModel):
    # NaN and Infinity are legal in Python's JSON parser, never a meaningful value here
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


def _null_is_default(fields: Any, nullable: tuple[str, ...] = ()) -> Any:
    """SGLang reads a null field as its default (its SamplingParams.__post_init__ and GenerateReqInput's
    normalize): drop every null but those of `nullable` fields, where null is a value."""
    if not isinstance(fields, dict):
        return fields
    return {key: value for key, value in fields.items() if value is not None or key in nullable}


class SamplingParams(_Lenient):
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

    _stop_is_utf8 = field_validator("stop")(_utf8_texts)

    @model_validator(mode="before")
    @classmethod
    def _nulls(cls, fields: Any) -> Any:
        fields = _null_is_default(fields, ("max_new_tokens",))
        if isinstance(fields, dict) and isinstance(fields.get("stop_token_ids"), list):  # SGLang drops null ids
            fields["stop_token_ids"] = [t for t in fields["stop_token_ids"] if t is not None]
        return fields

    @field_validator("temperature")
    @classmethod
    def _temperature_fits_float32(cls, value: float) -> float:
        if math.isinf(_float32(value)):
            raise ValueError(
                f"temperature={value!r} overflows float32: use a value up to 1e38 (0 = greedy, 1 = the model's own)"
            )
        return value

    @field_validator("top_p")
    @classmethod
    def _top_p_fits_float32(cls, value: float) -> float:
        if _float32(value) == 0.0:
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


class GenerateRequest(_Lenient):
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

    _texts_are_utf8 = field_validator("text", "rid", "lora_path")(_utf8_texts)

    @model_validator(mode="before")
    @classmethod
    def _nulls(cls, fields: Any) -> Any:
        return _null_is_default(fields)  # return_logprob: null -> False, logprob_start_len: null -> -1, ...

    @model_validator(mode="after")
    def _one_prompt_field(self) -> GenerateRequest:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of 'text' or 'input_ids'")
        if not self.token_ids_logprob:  # SGLang: [] means none
            self.token_ids_logprob = None
        return self


class UpdateWeightsFromDiskRequest(_Lenient):
    model_path: Utf8Str
    load_format: Utf8Str | None = None
    abort_all_requests: bool = False
    weight_version: Utf8Str | None = None
    flush_cache: bool = True


class UpdateWeightsFromTensorRequest(_Lenient):
    serialized_named_tensors: list[Utf8Str]  # one base64 payload per tp rank (rollfleet.wire.serialize)
    load_format: Literal["direct", "flattened_bucket"] | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: Utf8Str | None = None


class InitWeightsUpdateGroupRequest(_Lenient):
    master_address: HostStr
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(le=2**31 - 1)
    world_size: int = Field(ge=2, le=2**31 - 1)
    group_name: Utf8Str = "weight_update_group"
    backend: Utf8Str = "nccl"
    timeout_s: float = Field(
        60.0,
        gt=0,
        le=MAX_TIMEOUT_S,
        description="rollfleet extension: give up joining after this long; "
        "also the longest wait for each later broadcast in this group",
    )


class UpdateWeightsFromDistributedRequest(_Lenient):
    names: list[Utf8Str]
    dtypes: list[Utf8Str]
    shapes: list[list[int]]
    group_name: Utf8Str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: Utf8Str | None = None
    load_format: Literal["flattened_bucket"] | None = None
    # rollfleet extension (rollfleet.engine.weights.call_order): numbered calls run in number order
    rollfleet_sync_id: Utf8Str | None = None
    rollfleet_call: int | None = Field(None, ge=0)

    @field_validator("shapes")
    @classmethod
    def _shapes_fit_memory(cls, shapes: list[list[int]]) -> list[list[int]]:
        for index, shape in enumerate(shapes):
            if math.prod(abs(d) for d in shape) * 8 > MAX_TENSOR_BYTES:
                raise ValueError(
                    f"shapes[{index}]={shape} holds more elements than any tensor can: give the tensor's real shape"
                )
        return shapes


class DestroyWeightsUpdateGroupRequest(_Lenient):
    group_name: Utf8Str = "weight_update_group"


class UpdateWeightVersionRequest(_Lenient):
    new_version: Utf8Str
    abort_all_requests: bool = False


class GetWeightsByNameRequest(_Lenient):
    name: Utf8Str
    truncate_size: int = Field(100, ge=1)


class MemoryRequest(_Lenient):
    tags: list[Literal["weights", "kv_cache", "cuda_graph"]] | None = None


class AbortRequest(_Lenient):
    rid: Utf8Str = ""
    abort_all: bool = False


class PauseGenerationRequest(_Lenient):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class FinishReason(BaseModel):
    type: Literal["stop", "length", "abort"]
    matched: int | str | None = None
    length: int | None = None
    message: str | None = None

    def to_wire(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True)


class LoadLoraAdapterRequest(_Lenient):
    lora_name: Utf8Str = Field(min_length=1)
    lora_path: Utf8Str  # a peft adapter directory: adapter_config.json + adapter_model.safetensors
    pinned: bool = False  # never evicted past --max-loaded-loras (rollfleet.engine.lora.lora_recency)


class LoadLoraAdapterFromTensorsRequest(_Lenient):
    """Exactly one of `serialized_named_tensors` (SGLang >= 0.5.2x: one payload per tp rank, each rank
    reads its own) and `serialized_tensors` (older SGLang, UniRL: one payload every rank reads). A
    payload holds a dict {peft key: tensor} (SGLang), a list of (key, tensor) pairs, or with
    load_format "flattened_bucket" a bucket (or a list of them)."""

    lora_name: Utf8Str = Field(min_length=1)
    config_dict: dict[Utf8Str, Any]  # the peft LoraConfig as saved in adapter_config.json
    serialized_named_tensors: list[Utf8Str] | None = None
    serialized_tensors: Utf8Str | None = None
    load_format: Literal["direct", "flattened_bucket"] | None = None
    pinned: bool = False

    @model_validator(mode="after")
    def _one_payload_field(self) -> LoadLoraAdapterFromTensorsRequest:
        if (self.serialized_named_tensors is None) == (self.serialized_tensors is None):
            raise ValueError(
                "give exactly one of 'serialized_named_tensors' (one payload per tp rank) or "
                "'serialized_tensors' (one payload for every rank)"
            )
        return self

    def payloads(self, tp_size: int) -> list[str]:
        """One payload per tp rank (the single `serialized_tensors` is read by every rank, as SGLang did)."""
        if self.serialized_tensors is not None:
            return [self.serialized_tensors] * tp_size
        return self.serialized_named_tensors


class UnloadLoraAdapterRequest(_Lenient):
    lora_name: Utf8Str


class WeightsFingerprintRequest(_Lenient):
    """rollfleet extension: which tensors (checkpoint names; None = all) and how many samples each;
    with `lora_name`, the tensors of that loaded adapter (peft keys) instead of the model's."""

    names: list[Utf8Str] | None = None
    samples: int = Field(4096, ge=1)
    lora_name: Utf8Str | None = None


# ---- R-Fork (rollfleet.wire.remote_instance): load weights from a running engine -------------------
def _ports_field(ports: str) -> str:
    parse_ports(ports)
    return ports


class InitWeightsSendGroupForRemoteInstanceRequest(_Lenient):
    """SGLang's InitWeightsSendGroupForRemoteInstanceReqInput (sent to the seed by the destination)."""

    master_address: HostStr
    ports: Annotated[Utf8Str, AfterValidator(_ports_field)]
    group_rank: int
    world_size: int
    group_name: Utf8Str = Field("weight_send_group", min_length=1)
    backend: Utf8Str = "nccl"

    @field_validator("group_rank")
    @classmethod
    def _seed_is_rank_0(cls, value: int) -> int:
        if value != 0:
            raise ValueError(f"group_rank={value}: the seed broadcasts, so it is group rank 0: send group_rank 0")
        return value

    @field_validator("world_size")
    @classmethod
    def _pairs(cls, value: int) -> int:
        if value != 2:
            raise ValueError(f"world_size={value}: each group is one seed rank and one destination rank: send 2")
        return value

    @field_validator("backend")
    @classmethod
    def _backend(cls, value: str) -> str:
        if value not in ("nccl", "gloo"):
            raise ValueError(f"backend={value!r}: use 'nccl' (GPU) or 'gloo' (CPU)")
        return value


class SendWeightsToRemoteInstanceRequest(_Lenient):
    """SGLang's SendWeightsToRemoteInstanceReqInput."""

    master_address: HostStr
    ports: Annotated[Utf8Str, AfterValidator(_ports_field)]
    group_name: Utf8Str = Field("weight_send_group", min_length=1)


class LoadFromRemoteInstanceRequest(_Lenient):
    """rollfleet extension: a running engine pulls its weights from a seed (the destination's side of
    R-Fork, which SGLang runs only at start)."""

    seed_host: HostStr
    seed_port: int = Field(ge=1, le=65535)
    ports: Annotated[Utf8Str, AfterValidator(_ports_field)]
    group_name: Utf8Str | None = Field(None, min_length=1, description="default: send_weights_<this engine's host>")
    backend: Literal["nccl", "gloo"] | None = Field(None, description="default: nccl on GPU, gloo on CPU")
    timeout_s: float = Field(300.0, gt=0, le=MAX_TIMEOUT_S, description="bound on the join and on each broadcast")
