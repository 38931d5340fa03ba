"""LoRA adapter routes.

Loading only stores an adapter (the weights change when a batch asks for it), so it needs no idle
engine. Unloading waits until no unfinished request uses the adapter, and new requests naming it
are refused meanwhile. Past --max-loaded-loras a load evicts the least recently used unpinned
adapters that way (rollfleet.engine.lora.lora_recency); loads and unloads run one at a time.
Answers: `{"success", "error_message", "loaded_adapters"}` (400 with `message` too on a refusal).

rollfleet extension: a load from tensors may carry `rollfleet_weight_version` and
`rollfleet_unload_lora_names` (`rollfleet_lora_load_then_version` in /get_server_info): once the
adapter is loaded, the version is set and those adapters unloaded, each as its own route would do it,
in the same call (the lora transport's sync to one engine: one round trip instead of two). The names
are checked before anything loads.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from rollfleet.engine.http.routes.weights import set_weight_version
from rollfleet.engine.http.service import BadRequest, Engine, EngineService
from rollfleet.engine.lora.lora_merge import LORA_OFF
from rollfleet.engine.tp.lockstep import Action
from rollfleet.wire.control_requests import (
    LoadLoraAdapterFromTensorsRequest,
    LoadLoraAdapterRequest,
    UnloadLoraAdapterRequest,
)

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
    return await load_and_evict(engine, req.lora_name, req.pinned, lora_path=req.lora_path)


@router.post("/load_lora_adapter_from_tensors")
async def load_lora_adapter_from_tensors(req: LoadLoraAdapterFromTensorsRequest, engine: Engine):
    payloads = req.payloads(engine.args.tp_size)
    if problem := engine.not_one_per_rank(payloads):
        return lora_reply(engine, problem)
    source = {"config_dict": req.config_dict, "serialized_named_tensors": payloads, "load_format": req.load_format}
    async with engine.lora_lock:
        if problem := then_refusal(engine, req):
            return lora_reply(engine, problem)
        reply = await load_and_evict_locked(engine, req.lora_name, req.pinned, **source)
        if isinstance(reply, JSONResponse):
            return reply
        # queued together, as a sender calling the two routes would: the engine thread runs them back to back
        then = [
            unload(engine, name)
            for name in req.rollfleet_unload_lora_names or ()
            if name in engine.runner.lora.adapters
        ]
        if req.rollfleet_weight_version is not None:
            then.append(set_weight_version(engine, req.rollfleet_weight_version))
        refused = [reply for reply in await asyncio.gather(*then) if isinstance(reply, JSONResponse)]
        return refused[0] if refused else lora_reply(engine)


def then_refusal(engine: EngineService, req: LoadLoraAdapterFromTensorsRequest) -> str | None:
    """Why the adapters a load would unload after it (`rollfleet_unload_lora_names`) are refused,
    before anything loads: each must be loaded now, named once, and not the one being loaded."""
    names, loaded = req.rollfleet_unload_lora_names or [], engine.runner.lora.adapters
    for name in names:
        if name == req.lora_name:
            why = "the adapter this call loads"
        elif name not in loaded:
            why = "not loaded"
        elif names.count(name) > 1:
            why = "named twice"
        else:
            continue
        return (
            f"rollfleet_unload_lora_names={names!r}: {name!r} is {why} (loaded: {sorted(loaded)}); "
            "name each loaded adapter to unload once, never the one being loaded"
        )
    return None


async def load_and_evict(engine: EngineService, name: str, pinned: bool, **source):
    async with engine.lora_lock:
        return await load_and_evict_locked(engine, name, pinned, **source)


async def load_and_evict_locked(engine: EngineService, name: str, pinned: bool, **source):
    """Load an adapter; then, past --max-loaded-loras, unload the least recently used unpinned ones
    (SGLang's order: rollfleet.engine.lora.lora_recency), each after the requests using it finished.
    The caller holds `engine.lora_lock`."""
    limits = engine.runner.lora.limits
    max_loaded = limits.max_loaded if limits is not None else None
    if pinned and (refusal := engine.lora_recency.pinned_refusal(name, max_loaded)):
        return lora_reply(engine, refusal)
    reply = await lora_control(engine, Action.LOAD_LORA_ADAPTER, lora_name=name, **source)
    if isinstance(reply, JSONResponse):
        return reply
    engine.lora_recency.loaded(name, pinned)
    while max_loaded is not None and len(engine.runner.lora.adapters) > max_loaded:
        victim = engine.lora_recency.victim(engine.runner.lora.adapters)
        assert victim is not None, "a pinned load always leaves an unpinned adapter to evict"
        evicted = await unload(engine, victim)
        if isinstance(evicted, JSONResponse):
            return evicted
    return lora_reply(engine)


@router.post("/unload_lora_adapter")
async def unload_lora_adapter(req: UnloadLoraAdapterRequest, engine: Engine):
    async with engine.lora_lock:
        return await unload(engine, req.lora_name)


async def unload(engine: EngineService, name: str):
    """Unload once no unfinished request uses the adapter; new requests naming it are refused meanwhile."""
    if engine.runner.lora.limits is not None and name in engine.runner.lora.adapters:
        engine.unloading.add(name)
    try:
        reply = await lora_control(
            engine, Action.UNLOAD_LORA_ADAPTER, waits_for=lambda seq: seq.lora_name == name, lora_name=name
        )
    finally:
        engine.unloading.discard(name)
    if name not in engine.runner.lora.adapters:
        engine.lora_recency.unloaded(name)
    return reply
