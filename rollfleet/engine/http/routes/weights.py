"""Weight routes: updates (disk, tensor, distributed), weight-update groups and sessions, the
version label, and weight reads (by name, fingerprints)."""

from __future__ import annotations

import contextlib
from typing import Literal

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from rollfleet.engine.http.service import Answer, BadRequest, Engine, EngineService
from rollfleet.engine.tp.lockstep import Action
from rollfleet.engine.weights.call_order import CallOrderError
from rollfleet.wire.control_requests import (
    DestroyWeightsUpdateGroupRequest,
    GetWeightsByNameRequest,
    InitWeightsUpdateGroupRequest,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromDistributedRequest,
    UpdateWeightsFromTensorRequest,
    UpdateWeightVersionRequest,
    WeightsFingerprintRequest,
)

router = APIRouter()
# the routes whose calls count in a weight-update session (a refusal of any fails the session)
UPDATE_ROUTES = ("/update_weights_from_disk", "/update_weights_from_tensor", "/update_weights_from_distributed")


class BeginWeightUpdateRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    selector: Literal["all", "target", "draft"] = "all"


class EndWeightUpdateRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")


@contextlib.contextmanager
def counted_in_session(engine: EngineService, route: str):
    """A refusal of this call fails an open weight-update session."""
    try:
        yield
    except (BadRequest, CallOrderError) as exc:
        engine.sessions.after_refusal(route, getattr(exc, "message", str(exc)))
        raise


async def update(
    engine: EngineService, action: Action, weight_version: str | None, *, abort_first: bool, queued=None, **kwargs
) -> None:
    """Run an update on the engine thread once the running batch ended (at once while generation
    is paused); its version applies now, or at the end of an open session. A batch paused under it
    recomputes its KV cache with the new weights before it goes on."""

    def run():
        names = engine.lockstep(action, **kwargs)
        engine.scheduler.weights_changed()
        engine.sessions.after_update(names, weight_version)

    await engine.control(run, abort_first=abort_first, queued=queued)


@router.post("/update_weights_from_disk")
async def update_weights_from_disk(req: UpdateWeightsFromDiskRequest, engine: Engine):
    with counted_in_session(engine, "/update_weights_from_disk"):
        if req.load_format not in (None, "auto", "safetensors"):
            raise BadRequest(f"load_format={req.load_format!r}: the embedded engine reads safetensors only")
        try:
            await update(
                engine,
                Action.UPDATE_WEIGHTS_FROM_DISK,
                req.weight_version,
                abort_first=req.abort_all_requests,
                model_path=req.model_path,
            )
        except BadRequest as exc:
            engine.sessions.after_refusal("/update_weights_from_disk", exc.message)
            return JSONResponse({"success": False, "message": exc.message, "num_paused_requests": 0}, 400)
    engine.loaded_from = req.model_path  # /get_model_info reports it, as SGLang does
    return {"success": True, "message": f"loaded weights from {req.model_path}", "num_paused_requests": 0}


@router.post("/update_weights_from_tensor")
async def update_weights_from_tensor(req: UpdateWeightsFromTensorRequest, engine: Engine):
    with counted_in_session(engine, "/update_weights_from_tensor"):
        if problem := engine.not_one_per_rank(req.serialized_named_tensors):
            raise BadRequest(problem)
        # The entries are small (shared-memory / CUDA IPC handles): every rank gets the whole list and
        # decodes only its own entry.
        await update(
            engine,
            Action.UPDATE_WEIGHTS_FROM_TENSOR,
            req.weight_version,
            abort_first=req.abort_all_requests,
            serialized_named_tensors=req.serialized_named_tensors,
            load_format=req.load_format,
        )
    return {"success": True, "message": "Succeeded to update model weights."}


@router.post("/update_weights_from_distributed")
async def update_weights_from_distributed(req: UpdateWeightsFromDistributedRequest, engine: Engine):
    with counted_in_session(engine, "/update_weights_from_distributed"):
        try:
            await update(
                engine,
                Action.UPDATE_WEIGHTS_FROM_DISTRIBUTED,
                req.weight_version,
                abort_first=req.abort_all_requests,
                queued=engine.call_order.turn(req.rollfleet_sync_id, req.rollfleet_call),
                names=req.names,
                dtypes=req.dtypes,
                shapes=req.shapes,
                group_name=req.group_name,
                load_format=req.load_format,
            )
        except CallOrderError as exc:
            raise BadRequest(str(exc)) from exc
    return {"success": True, "message": "Succeeded to update parameter online."}


@router.post("/init_weights_update_group")
async def init_weights_update_group(req: InitWeightsUpdateGroupRequest, engine: Engine):
    # Blocks the engine thread (not HTTP) until every rank joined or timeout_s passed; it needs no
    # idle engine, so a running batch pauses for the join at most.
    await engine.control(
        lambda: engine.lockstep(
            Action.INIT_WEIGHTS_UPDATE_GROUP,
            master_address=req.master_address,
            master_port=req.master_port,
            rank_offset=req.rank_offset,
            world_size=req.world_size,
            group_name=req.group_name,
            backend=req.backend,
            timeout_s=req.timeout_s,
        ),
        needs_idle=False,
    )
    return {"success": True, "message": f"joined weight update group {req.group_name!r}"}


@router.post("/destroy_weights_update_group")
async def destroy_weights_update_group(req: DestroyWeightsUpdateGroupRequest, engine: Engine):
    await engine.control(
        lambda: engine.lockstep(Action.DESTROY_WEIGHTS_UPDATE_GROUP, group_name=req.group_name), needs_idle=False
    )
    return {"success": True, "message": f"destroyed weight update group {req.group_name!r}"}


@router.post("/begin_weight_update")
async def begin_weight_update(engine: Engine, req: BeginWeightUpdateRequest | None = None):
    """Open a weight-update session (weight_session.py says what it guarantees)."""
    selector = (req or BeginWeightUpdateRequest()).selector

    def begin() -> tuple[str, str | None]:
        message = engine.sessions.begin(selector, engine.runner.weights_released())
        return message, engine.runner.weights.resident_mapping

    message, mapping = await engine.control(begin, needs_idle=False)
    # the sender's mapping this engine keeps (load_format "rollfleet_resident"): it may send the id alone
    return {"success": True, "message": message, "rollfleet_resident_mapping": mapping}


@router.post("/end_weight_update")
async def end_weight_update(engine: Engine, req: EndWeightUpdateRequest | None = None):
    """Commit the open session when it was complete; else 400 naming what is missing or refused."""

    def end() -> str:
        # the session's end is the sync's end, as a version is without one: the sender's buffers go
        # (held, a colocated trainer could not give them back before this engine's resume)
        engine.lockstep(Action.DROP_HELD_PAYLOADS)
        return engine.sessions.end()

    message = await engine.control(end, needs_idle=False)
    return {"success": True, "message": message}


@router.post("/update_weight_version")
async def update_weight_version(req: UpdateWeightVersionRequest, engine: Engine):
    applied = await set_weight_version(engine, req.new_version, abort_first=req.abort_all_requests)
    message = "weight version updated" if applied else "weight version held: it applies at end_weight_update"
    return {"success": True, "message": message, "new_version": req.new_version}


async def set_weight_version(engine: EngineService, version: str, *, abort_first: bool = False) -> bool:
    """The weight version, once no batch runs (the end of a sync): applied now (True), or held for a
    session's end (False). Also what a LoRA load that carries `rollfleet_weight_version` does."""

    def set_version() -> bool:
        engine.lockstep(Action.DROP_HELD_PAYLOADS)  # a version marks the end of a sync
        return engine.sessions.set_version(version)

    return await engine.control(set_version, abort_first=abort_first)


@router.api_route("/get_weights_by_name", methods=["GET", "POST"])
async def get_weights_by_name(req: GetWeightsByNameRequest, engine: Engine):
    return Answer(
        await engine.control(
            lambda: engine.lockstep(Action.GET_WEIGHTS_BY_NAME, name=req.name, truncate_size=req.truncate_size),
            needs_idle=False,
        )
    )


@router.get("/rollfleet/shard_fingerprints")
async def shard_fingerprints(engine: Engine):
    """rollfleet extension: sha256 of every tp rank's local shard of every parameter."""
    return await engine.control(lambda: engine.lockstep(Action.SHARD_FINGERPRINTS), needs_idle=False)


@router.post("/rollfleet/weights_fingerprint")
async def weights_fingerprint(req: WeightsFingerprintRequest, engine: Engine):
    """rollfleet extension: fingerprints of full tensors by checkpoint name (sync verification; every
    tensor the engine holds when `names` is null), or of a loaded LoRA adapter's tensors by peft key
    (`lora_name`)."""
    if req.lora_name is not None:
        return await engine.control(
            lambda: engine.lockstep(
                Action.LORA_FINGERPRINTS, lora_name=req.lora_name, names=req.names, samples=req.samples
            ),
            needs_idle=False,
        )
    return await engine.control(
        lambda: engine.lockstep(Action.WEIGHTS_FINGERPRINT, names=req.names, samples=req.samples), needs_idle=False
    )
