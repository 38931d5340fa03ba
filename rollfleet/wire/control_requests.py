"""Request models of SGLang's control routes: weight updates and their groups, weight reads and
fingerprints, memory release and resume, aborts and pauses, LoRA adapters, and R-Fork's weight
transfer between engines. Field names and defaults are SGLang's; rollfleet's extensions say so."""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, field_validator, model_validator

from rollfleet.wire.remote_instance import parse_ports
from rollfleet.wire.request_fields import HostStr, Lenient, Utf8Str

MAX_TIMEOUT_S = 86400.0  # one day: longer waits are a mistake, and timedelta overflows on absurd ones
MAX_TENSOR_BYTES = 2**62  # a shape whose numel * 8 bytes goes past this cannot be allocated anywhere


class UpdateWeightsFromDiskRequest(Lenient):
    model_path: Utf8Str
    load_format: Utf8Str | None = None
    abort_all_requests: bool = False
    weight_version: Utf8Str | None = None
    flush_cache: bool = True


# the embedded engine's own load_format (never sent to SGLang): a sender's parameters mapped once, then
# loaded again by id (rollfleet.weights.transports.resident, rollfleet.engine.tp.payloads)
RESIDENT_LOAD_FORMAT = "rollfleet_resident"
# what an engine's refusal of an id it does not hold says (a restarted engine holds none): the sender
# then sends what the id stands for again
MAPPING_NOT_HELD = "is not held by this engine"


class UpdateWeightsFromTensorRequest(Lenient):
    serialized_named_tensors: list[Utf8Str]  # one base64 payload per tp rank (rollfleet.wire.serialize)
    load_format: Literal["direct", "flattened_bucket", "rollfleet_resident"] | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: Utf8Str | None = None


class InitWeightsUpdateGroupRequest(Lenient):
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


class UpdateWeightsFromDistributedRequest(Lenient):
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


class DestroyWeightsUpdateGroupRequest(Lenient):
    group_name: Utf8Str = "weight_update_group"


class UpdateWeightVersionRequest(Lenient):
    new_version: Utf8Str
    abort_all_requests: bool = False


class GetWeightsByNameRequest(Lenient):
    name: Utf8Str
    truncate_size: int = Field(100, ge=1)


class MemoryRequest(Lenient):
    tags: list[Literal["weights", "kv_cache", "cuda_graph"]] | None = None


class AbortRequest(Lenient):
    rid: Utf8Str = ""
    abort_all: bool = False


class PauseGenerationRequest(Lenient):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class LoadLoraAdapterRequest(Lenient):
    lora_name: Utf8Str = Field(min_length=1)
    lora_path: Utf8Str  # a peft adapter directory: adapter_config.json + adapter_model.safetensors
    pinned: bool = False  # never evicted past --max-loaded-loras (rollfleet.engine.lora.lora_recency)


class LoadLoraAdapterFromTensorsRequest(Lenient):
    """Exactly one of `serialized_named_tensors` (SGLang >= 0.5.2x: one payload per tp rank, each rank
    reads its own) and `serialized_tensors` (older SGLang, UniRL: one payload every rank reads). A
    payload holds a dict {peft key: tensor} (SGLang), a list of (key, tensor) pairs, or with
    load_format "flattened_bucket" a bucket (or a list of them)."""

    lora_name: Utf8Str = Field(min_length=1)
    config_dict: dict[Utf8Str, Any]  # the peft LoraConfig as saved in adapter_config.json
    serialized_named_tensors: list[Utf8Str] | None = None
    serialized_tensors: Utf8Str | None = None
    load_format: Literal["direct", "flattened_bucket", "rollfleet_resident"] | None = None
    pinned: bool = False
    # rollfleet extension (`rollfleet_lora_load_then_version` in /get_server_info): once loaded, set
    # this weight version and unload these adapters, as /update_weight_version and /unload_lora_adapter
    # would: a one-engine sync in one round trip
    rollfleet_weight_version: Utf8Str | None = None
    rollfleet_unload_lora_names: list[Utf8Str] | None = None

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


class UnloadLoraAdapterRequest(Lenient):
    lora_name: Utf8Str


class WeightsFingerprintRequest(Lenient):
    """rollfleet extension: which tensors (checkpoint names; None = all) and how many samples each;
    with `lora_name`, the tensors of that loaded adapter (peft keys) instead of the model's."""

    names: list[Utf8Str] | None = None
    samples: int = Field(4096, ge=1)
    lora_name: Utf8Str | None = None


# ---- R-Fork (rollfleet.wire.remote_instance): load weights from a running engine -------------------
def _ports_field(ports: str) -> str:
    parse_ports(ports)
    return ports


class InitWeightsSendGroupForRemoteInstanceRequest(Lenient):
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


class SendWeightsToRemoteInstanceRequest(Lenient):
    """SGLang's SendWeightsToRemoteInstanceReqInput."""

    master_address: HostStr
    ports: Annotated[Utf8Str, AfterValidator(_ports_field)]
    group_name: Utf8Str = Field("weight_send_group", min_length=1)


class LoadFromRemoteInstanceRequest(Lenient):
    """rollfleet extension: a running engine pulls its weights from a seed (the destination's side of
    R-Fork, which SGLang runs only at start)."""

    seed_host: HostStr
    seed_port: int = Field(ge=1, le=65535)
    ports: Annotated[Utf8Str, AfterValidator(_ports_field)]
    group_name: Utf8Str | None = Field(None, min_length=1, description="default: send_weights_<this engine's host>")
    backend: Literal["nccl", "gloo"] | None = Field(None, description="default: nccl on GPU, gloo on CPU")
    timeout_s: float = Field(300.0, gt=0, le=MAX_TIMEOUT_S, description="bound on the join and on each broadcast")
