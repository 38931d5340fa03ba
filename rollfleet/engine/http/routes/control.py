"""Status, memory, abort and pause routes."""

from __future__ import annotations

import asyncio
import os

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from rollfleet.engine.http.service import VERSION, BadRequest, Engine, EngineService
from rollfleet.engine.runtime.memory_tags import ReleasedTags
from rollfleet.engine.runtime.scheduler import EngineStopped
from rollfleet.engine.tp.lockstep import Action
from rollfleet.wire.buckets import dtype_name
from rollfleet.wire.control_requests import AbortRequest, MemoryRequest, PauseGenerationRequest

router = APIRouter()


class StepRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    steps: int = Field(1, ge=1, le=1_000_000, description="steps to run: a batch's prefill or one decode step each")


@router.get("/get_model_info")
@router.get("/model_info")
async def model_info(engine: Engine):
    args = engine.args
    return {
        "model_path": engine.model_path,  # the last disk update's, as SGLang reports it
        "tokenizer_path": args.tokenizer_path or args.model_path,
        "is_generation": True,
        "weight_version": engine.scheduler.weight_version,
        "weights_ready": engine.weights_ready,
        "context_length": engine.context_length,
        "dtype": dtype_name(engine.runner.dtype),
        "loaded_lora_adapters": engine.loaded_adapters(),
    }


@router.get("/get_weight_version")
async def get_weight_version(engine: Engine):
    """SGLang before 0.5.21 (removed there; slime's engine wrapper still reads it): the version label."""
    return {"weight_version": engine.scheduler.weight_version}


@router.get("/get_server_info")
@router.get("/server_info")
async def server_info(engine: Engine):
    args = engine.args
    info = {k: v for k, v in vars(args).items() if k not in ("api_key", "admin_api_key")}
    return {
        **info,
        "api_key_set": bool(args.api_key),
        "admin_api_key_set": bool(args.admin_api_key),
        "version": VERSION,
        "engine": "rollfleet-embedded",
        # SGLang's KV pool size (the paged pool's; the dense cache has none: the most a full batch may hold)
        "max_total_num_tokens": args.max_total_tokens or args.max_running_requests * engine.context_length,
        "rollfleet_kv_cache": engine.kv_report(),
        "weight_version": engine.scheduler.weight_version,
        "weights_ready": engine.weights_ready,
        "scheduler_stats": engine.scheduler.live_stats,
        "loaded_lora_adapters": engine.loaded_adapters(),
        "rollfleet_ordered_weight_calls": True,
        "rollfleet_weight_calls_waiting": engine.call_order.waiting,
        "rollfleet_weight_update_sessions": True,
        # load_format "rollfleet_resident": a sender's parameters mapped once, loaded again by id
        "rollfleet_resident_weights": True,
        # an adapter loaded from tensors is copied at load: its sender may reuse the buffer next sync
        "rollfleet_lora_copied_at_load": True,
        # load_format "rollfleet_resident" for adapters: that buffer mapped once, named by id after
        "rollfleet_lora_resident": True,
        # a load from tensors may carry the version to set and the adapters to unload once it loaded
        "rollfleet_lora_load_then_version": True,
        # /generate's return_logprob_values: output logprobs as one list of values (wire/protocol.py)
        "rollfleet_logprob_values": True,
        # adapters being unloaded (an unload, or an eviction past --max-loaded-loras): new requests naming
        # them get 400 while the requests already using them finish
        "rollfleet_lora_unloading": sorted(engine.unloading),
        "rollfleet_remote_instance": engine.remote.report(),
        "rollfleet_released_memory": sorted(engine.memory_tags.released),  # tags released and not resumed
        "start_breakdown": engine.start_breakdown,  # seconds per phase of this engine's start
        # the GPUs this server was given (a zygote-forked engine sets it after fork, so /proc/PID/environ
        # still shows the zygote's)
        "rollfleet_cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "rollfleet_pid": os.getpid(),  # a launcher checks that the server on its port is its own process
    }


@router.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache(engine: Engine):
    if engine.scheduler.num_unfinished:
        return PlainTextResponse("Cache not flushed: requests are running.", status_code=400)
    await engine.control(engine.scheduler.batches.flush, needs_idle=False)
    return PlainTextResponse("Cache flushed.")


@router.get("/rollfleet/memory")
async def memory(engine: Engine):
    """rollfleet extension: memory per tp rank (weights; allocator and device figures on GPU)."""
    return await engine.control(lambda: engine.lockstep(Action.MEMORY), needs_idle=False)


async def move_memory(engine: EngineService, req: MemoryRequest, action: Action) -> dict:
    # cuda_graph: the decode graphs' memory goes (kept captured under torch_memory_saver, else dropped
    # and captured again on demand). A release names tags already
    # released too (SGLang 0.5.23 accepts it): the model frees only what it still holds
    tags = ReleasedTags.of(req.tags)

    def act():
        if engine.scheduler.num_unfinished:
            raise ValueError(
                f"{engine.scheduler.num_unfinished} requests are unfinished: pause or abort them "
                "before releasing or resuming memory"
            )
        if action is Action.RESUME_MEMORY:
            engine.memory_tags.check_resume(tags)
            engine.lockstep(action, tags=tags)
            return engine.memory_tags.after_resume(tags)
        engine.sessions.check_release(tags)
        # a host copy only of weights that may be served again (not of a session's mixed ones)
        backup = engine.args.enable_weights_cpu_backup and engine.sessions.mixed is None
        engine.lockstep(action, tags=tags, cpu_backup=backup)
        engine.sessions.after_release(tags)
        engine.memory_tags.after_release(tags)

    await engine.control(act)
    return None  # SGLang answers release and resume with an empty (null) body; GET /rollfleet/memory says more


@router.post("/release_memory_occupation")
async def release_memory_occupation(req: MemoryRequest, engine: Engine):
    return await move_memory(engine, req, Action.RELEASE_MEMORY)


@router.post("/resume_memory_occupation")
async def resume_memory_occupation(req: MemoryRequest, engine: Engine):
    return await move_memory(engine, req, Action.RESUME_MEMORY)


@router.post("/abort_request")
async def abort_request(req: AbortRequest, engine: Engine):
    if not req.rid and not req.abort_all:
        raise BadRequest("give rid or abort_all=true")
    engine.scheduler.abort(req.rid, req.abort_all)
    return Response(status_code=200)  # SGLang's empty 200


@router.post("/pause_generation")
async def pause_generation(req: PauseGenerationRequest, engine: Engine):
    """SGLang's modes: "abort" ends every unfinished request, "in_place" keeps the running batch,
    "retract" queues it again without its KV cache; answers once the engine has acted."""
    try:
        await asyncio.wrap_future(engine.scheduler.pause(req.mode))
    except EngineStopped as exc:
        raise BadRequest(str(exc), 503) from exc
    return {"message": "Generation paused successfully.", "status": "ok"}


@router.post("/rollfleet/step")
async def step(req: StepRequest, engine: Engine):
    """rollfleet extension: a paused engine runs `steps` more steps (a prefill or one decode step of
    the batch each), then holds again; answers once they ran, or nothing was left to run."""
    try:
        ran = await asyncio.wrap_future(engine.scheduler.step(req.steps))
    except ValueError as exc:
        raise BadRequest(str(exc)) from exc
    except EngineStopped as exc:
        raise BadRequest(str(exc), 503) from exc
    return {"steps_run": ran, "scheduler_stats": engine.scheduler.live_stats}


@router.post("/continue_generation")
async def continue_generation(engine: Engine):
    engine.scheduler.resume()
    return {"message": "Generation continued successfully.", "status": "ok"}


@router.get("/ready")
async def ready(engine: Engine):
    """SGLang's readiness probe: 200 when new requests would be served now, else 503."""
    return Response(status_code=503 if engine.not_serving_reason() else 200)
