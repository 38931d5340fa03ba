"""Request and response models of the SGLang HTTP protocol: the one source of truth for field
names and defaults, shared by the embedded server and the client.

Only the subset rollfleet serves is modelled (see docs/architecture.md). Unknown fields are
ignored, as SGLang does, so a client built for a newer SGLang still talks to this server.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

GREEDY_TEMPERATURE = 1e-6  # SGLang: a temperature below this means argmax


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class SamplingParams(_Lenient):
    max_new_tokens: int = Field(128, ge=0)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = -1
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    n: int = Field(1, ge=1)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    sampling_seed: int | None = None
    min_new_tokens: int = Field(0, ge=0)

    @model_validator(mode="after")
    def _check(self) -> SamplingParams:
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k={self.top_k}: use -1 (all tokens) or a positive number")
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
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    stream: bool = False
    rid: str | list[str] | None = None
    lora_path: str | list[str | None] | None = None  # LoRA adapter name; a list: one per prompt

    @model_validator(mode="after")
    def _one_prompt_field(self) -> GenerateRequest:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of 'text' or 'input_ids'")
        if self.stream:
            raise ValueError("stream=true is not supported by the embedded engine; send stream=false")
        if self.top_logprobs_num:
            raise ValueError("top_logprobs_num > 0 is not supported by the embedded engine; send 0")
        return self


class UpdateWeightsFromDiskRequest(_Lenient):
    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    flush_cache: bool = True


class UpdateWeightsFromTensorRequest(_Lenient):
    serialized_named_tensors: list[str]  # one base64 payload per tp rank (rollfleet.wire.serialize)
    load_format: Literal["direct", "flattened_bucket"] | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None


class InitWeightsUpdateGroupRequest(_Lenient):
    master_address: str
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int
    world_size: int = Field(ge=2)
    group_name: str = "weight_update_group"
    backend: str = "nccl"
    timeout_s: float = Field(
        60.0,
        gt=0,
        description="rollfleet extension: give up joining after this long; "
        "also the longest wait for each later broadcast in this group",
    )


class UpdateWeightsFromDistributedRequest(_Lenient):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: Literal["flattened_bucket"] | None = None
    # rollfleet extension (rollfleet.engine.call_order): numbered calls run in number order
    rollfleet_sync_id: str | None = None
    rollfleet_call: int | None = Field(None, ge=0)


class DestroyWeightsUpdateGroupRequest(_Lenient):
    group_name: str = "weight_update_group"


class UpdateWeightVersionRequest(_Lenient):
    new_version: str
    abort_all_requests: bool = False


class GetWeightsByNameRequest(_Lenient):
    name: str
    truncate_size: int = Field(100, ge=1)


class MemoryRequest(_Lenient):
    tags: list[Literal["weights", "kv_cache", "cuda_graph"]] | None = None


class AbortRequest(_Lenient):
    rid: str = ""
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
    lora_name: str = Field(min_length=1)
    lora_path: str  # a peft adapter directory: adapter_config.json + adapter_model.safetensors
    pinned: bool = False  # SGLang keeps pinned adapters in GPU memory; every adapter stays loaded here


class LoadLoraAdapterFromTensorsRequest(_Lenient):
    lora_name: str = Field(min_length=1)
    config_dict: dict[str, Any]  # the peft LoraConfig as saved in adapter_config.json
    serialized_named_tensors: list[str]  # one payload per tp rank, as /update_weights_from_tensor
    load_format: Literal["direct", "flattened_bucket"] | None = None
    pinned: bool = False


class UnloadLoraAdapterRequest(_Lenient):
    lora_name: str


class WeightsFingerprintRequest(_Lenient):
    """rollfleet extension: which tensors (checkpoint names; None = all) and how many samples each;
    with `lora_name`, the tensors of that loaded adapter (peft keys) instead of the model's."""

    names: list[str] | None = None
    samples: int = Field(4096, ge=1)
    lora_name: str | None = None
