"""Each weight-sync transport's settings (`weight_sync:` in a run's config), one model per transport,
told apart by `transport`."""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import Field

from rollfleet.config.section import Section as _Section


class _WeightSync(_Section):
    """What every transport's settings share. `pipeline_parallel_problem`: why the transport cannot
    feed an SGLang engine with pp_size > 1 (None: it can)."""

    pipeline_parallel_problem: ClassVar[str | None] = None

    verify: Literal["auto", "fingerprint", "version"] = Field(
        "auto",
        description="After a sync: 'fingerprint' compares every tensor's fingerprint and the version "
        "(the embedded engine's /rollfleet/weights_fingerprint); 'version' checks only each engine's weight "
        "version (SGLang has no fingerprint route); auto: fingerprint on the embedded engine, version on SGLang.",
    )


class _Bucketed(_WeightSync):
    """The settings of a transport that moves weights in flattened buckets."""

    bucket_mb: float = Field(
        512,
        gt=0,
        description="Largest flattened bucket, in MiB; the sender holds "
        "two. Larger buckets mean fewer round trips (2048 suits 8B-class models).",
    )

    @property
    def bucket_bytes(self) -> int:
        return max(1, int(self.bucket_mb * (1 << 20)))


class TensorSync(_Bucketed):
    """Colocated: CUDA IPC (GPU) or shared-memory (CPU) handles through /update_weights_from_tensor."""

    transport: Literal["tensor"] = Field("tensor", description="Selects this transport.")
    pipeline_parallel_problem: ClassVar[str | None] = (
        "every pipeline stage of a tp rank reads the same payload (serialized_named_tensors is indexed "
        "by tp_rank only), and a CUDA IPC or shared-memory handle unpickled by several processes is "
        "released once too often; rollfleet has no per-stage routing for it yet"
    )
    resident: bool = Field(
        True,
        description="Map a one-rank trainer's parameters into embedded engines once and send only an id "
        "afterwards (no bucket copies); used when the trainer keeps its parameters in place between "
        "steps (no offload); false: always pack into buckets.",
    )


class NcclSync(_Bucketed):
    """Disaggregated: broadcast from trainer rank 0 to every engine rank (gloo on CPU)."""

    transport: Literal["nccl"] = Field("nccl", description="Selects this transport.")
    pipeline_parallel_problem: ClassVar[str | None] = "its weight-update group ignores the pipeline rank"
    master_address: str = Field("127.0.0.1", description="Address of trainer rank 0, reachable from every engine.")
    master_port: int | None = Field(None, ge=1, le=65535, description="Port of the group's store; None: a free one.")
    join_timeout_s: float = Field(120.0, gt=0.0, description="Seconds the group join may take before it fails.")


class DiskSync(_WeightSync):
    """An HF checkpoint directory and /update_weights_from_disk."""

    transport: Literal["disk"] = Field("disk", description="Selects this transport.")
    pipeline_parallel_problem: ClassVar[str | None] = None  # each stage reads its own layers from the directory
    path: str = Field("runs/weight-sync", description="Directory the trainer saves the synced weights into.")


class LoraSync(_WeightSync):
    """Only the LoRA adapter moves, as tensors or as a saved adapter directory; engines keep their base weights."""

    transport: Literal["lora"] = Field("lora", description="Selects this transport.")
    pipeline_parallel_problem: ClassVar[str | None] = (
        "LoRA serving with pipeline parallel has not been built or tested here"
    )
    source: Literal["tensors", "directory"] = Field("tensors", description="How the adapter reaches the engines.")
    path: str = Field(
        "checkpoints/adapter",
        description="Adapter directory: read when source=directory; each synced version is also kept "
        "below it (a restarted engine or a standby loads the current one from there).",
    )
    adapter_name: str = Field(
        "policy",
        min_length=1,
        description="Name the engines serve the adapter under (generate requests send it as lora_path).",
    )
    max_lora_rank: int = Field(64, ge=1, description="Largest adapter rank the engines accept (--max-lora-rank).")
    lora_target_modules: list[str] | None = Field(
        None,
        description="Modules adapters may target (--lora-target-modules, e.g. [q_proj, v_proj, embed_tokens]); "
        "None: any nn.Linear, and an untied embed_tokens at tp 1, on the embedded engine (SGLang needs them "
        "listed).",
    )
    resident: bool = Field(
        True,
        description="source=tensors to embedded engines: map the sender's reused adapter buffer into them "
        "once and name it by id afterwards (nothing serialized per sync); false: send the bucket's "
        "handles every sync.",
    )


WeightSyncConfig = Annotated[TensorSync | NcclSync | DiskSync | LoraSync, Field(discriminator="transport")]
