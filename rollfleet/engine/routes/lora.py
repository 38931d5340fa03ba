"""LoRA adapter routes.

Loading only stores an adapter (the weights change when a batch asks for it), so it needs no idle
engine. Unloading waits until no unfinished request uses the adapter, and new requests naming it
are refused meanwhile. Answers: `{"success", "error_message", "loaded_adapters"}` (400 with
`message` too on a refusal).
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from rollfleet.engine.lockstep import Action
from rollfleet.engine.lora_merge import LORA_OFF
from rollfleet.engine.service import BadRequest, Engine, EngineService
from rollfleet.wire.protocol import LoadLoraAdapterFromTensorsRequest, LoadLoraAdapterRequest, UnloadLoraAdapterRequest

router = APIRouter()


def lora_reply(engine: EngineService, error: str | None = None):
    body = {"success": error is None, "error_message": error or "", "loaded_adapters": engine.loaded_adapters()}
    return body if error is None else JSONResponse({**body, "message": error}, status_code=400)


async def lora_control(engine: EngineService, action: Action, *, waits_for=None, **kwargs):
    if engine.runner.lora.limits is None:
        return lora_reply(engine, LORA_OFF)
    try:
        await engine.control(lambda: engine.lockstep(action, **kwargs), needs_idle=False, waits_for=waits_for)
    except BadRequest as exc:
        return lora_reply(engine, exc.message)
    return lora_reply(engine)


@router.post("/load_lora_adapter")
async def load_lora_adapter(req: LoadLoraAdapterRequest, engine: Engine):
    return await lora_control(engine, Action.LOAD_LORA_ADAPTER, lora_name=req.lora_name, lora_path=req.lora_path)


@router.post("/load_lora_adapter_from_tensors")
async def load_lora_adapter_from_tensors(req: LoadLoraAdapterFromTensorsRequest, engine: Engine):
    if problem := engine.not_one_per_rank(req.serialized_named_tensors):
        return lora_reply(engine, problem)
    return await lora_control(
        engine,
        Action.LOAD_LORA_ADAPTER,
        lora_name=req.lora_name,
        config_dict=req.config_dict,
        serialized_named_tensors=req.serialized_named_tensors,
        load_format=req.load_format,
    )


@router.post("/unload_lora_adapter")
async def unload_lora_adapter(req: UnloadLoraAdapterRequest, engine: Engine):
    name = req.lora_name
    if engine.runner.lora.limits is not None and name in engine.runner.lora.adapters:
        engine.unloading.add(name)
    try:
        return await lora_control(
            engine, Action.UNLOAD_LORA_ADAPTER, waits_for=lambda seq: seq.lora_name == name, lora_name=name
        )
    finally:
        engine.unloading.discard(name)
