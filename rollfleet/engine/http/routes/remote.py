"""R-Fork routes (rollfleet.wire.remote_instance has the protocol): the seed's two SGLang routes, the
destination's pull (a rollfleet extension: SGLang pulls only at start), and the layout a
destination checks before any broadcast.

The seed serves one destination at a time: a second init while a transfer is open gets 409. Its
join and send run on the engine thread (as in SGLang's scheduler), so generation pauses while they
run; each is bounded by `--rollfleet-remote-instance-timeout-s`, and a joined group whose send
never comes is dropped after that long too. A failed transfer leaves the seed's weights untouched.
"""

from __future__ import annotations

import asyncio
import logging

from fastapi import APIRouter

from rollfleet.engine.http.remote_pull import SeedSource, load_from_seed
from rollfleet.engine.http.service import BadRequest, Engine, EngineService
from rollfleet.engine.tp.lockstep import Action
from rollfleet.wire.buckets import dtype_name
from rollfleet.wire.control_requests import (
    InitWeightsSendGroupForRemoteInstanceRequest,
    LoadFromRemoteInstanceRequest,
    SendWeightsToRemoteInstanceRequest,
)
from rollfleet.wire.remote_instance import INIT_ROUTE, LAYOUT_ROUTE, LOAD_ROUTE, SEND_ROUTE, parse_ports

router = APIRouter()
log = logging.getLogger("rollfleet.engine")


def check_ports(engine: EngineService, ports: str) -> None:
    count = len(parse_ports(ports))
    if count != engine.args.tp_size:
        raise BadRequest(
            f"ports={ports!r}: {count} ports for an engine of tp_size={engine.args.tp_size}: give one port per tp "
            "rank (seed and destination must have the same tp size)"
        )


@router.post(INIT_ROUTE)
async def init_weights_send_group_for_remote_instance(
    req: InitWeightsSendGroupForRemoteInstanceRequest, engine: Engine
):
    check_ports(engine, req.ports)
    remote = engine.remote
    if remote.serving is not None:
        raise BadRequest(
            f"busy: this seed is serving destination group {remote.serving!r} ({remote.stage}); it serves one "
            "destination at a time: retry when that transfer ended, or use another seed",
            409,
        )
    if not engine.weights_ready:
        raise BadRequest(
            f"this engine cannot seed: {engine.not_serving_reason() or 'its weights are not loaded'}; "
            "pick an engine that serves the fleet's version"
        )
    remote.serving, remote.stage = req.group_name, "joining"
    timeout_s = engine.args.rollfleet_remote_instance_timeout_s
    try:
        await engine.control(
            lambda: engine.lockstep(
                Action.REMOTE_INSTANCE_JOIN,
                master_address=req.master_address,
                ports=req.ports,
                group_rank=0,
                group_name=req.group_name,
                backend=req.backend,
                timeout_s=timeout_s,
            ),
            needs_idle=False,
        )
    except BaseException:
        remote.end_serving()
        raise
    remote.stage = "joined"
    remote.expiry = asyncio.create_task(_drop_if_never_sent(engine, req, timeout_s))
    return {"success": True, "message": f"Succeeded to init group through {req.master_address}:{req.ports} group."}


async def _drop_if_never_sent(engine: EngineService, req: InitWeightsSendGroupForRemoteInstanceRequest, wait_s: float):
    await asyncio.sleep(wait_s)
    if engine.remote.serving == req.group_name and engine.remote.stage == "joined":
        log.error("R-Fork: no send_weights call for group %r within %g s; dropping it", req.group_name, wait_s)
        await engine.control(
            lambda: engine.lockstep(Action.REMOTE_INSTANCE_DESTROY, ports=req.ports, group_name=req.group_name),
            needs_idle=False,
        )
        engine.remote.end_serving()


@router.post(SEND_ROUTE)
async def send_weights_to_remote_instance(req: SendWeightsToRemoteInstanceRequest, engine: Engine):
    check_ports(engine, req.ports)
    remote = engine.remote
    if remote.serving != req.group_name or remote.stage != "joined":
        raise BadRequest(
            f"group_name={req.group_name!r}: no joined group of that name here (serving: {remote.serving!r}, "
            f"{remote.stage}): call {INIT_ROUTE} first"
        )
    remote.stage = "sending"
    try:
        sent = await engine.control(
            lambda: engine.lockstep(Action.REMOTE_INSTANCE_SEND, ports=req.ports, group_name=req.group_name),
            needs_idle=False,
        )
    finally:
        remote.end_serving()
    return {
        "success": True,
        "message": f"Succeeded to send weights through {req.master_address}:{req.ports} {req.group_name} "
        f"({sent} bytes from tp rank 0).",
    }


@router.get(LAYOUT_ROUTE)
async def weight_layout(engine: Engine):
    """rollfleet extension: what a destination checks before any broadcast (no collective: every rank
    of an engine holds the same layout)."""
    return {
        "engine": "rollfleet-embedded",
        "tp_size": engine.args.tp_size,
        "ep_size": engine.args.ep_size,
        "dtype": dtype_name(engine.runner.dtype),
        "weight_version": engine.scheduler.weight_version,
        "weights_ready": engine.weights_ready,
        "serving_destination": engine.remote.serving,
        "parameters": engine.runner.remote.layout(),
    }


@router.post(LOAD_ROUTE)
async def load_from_remote_instance(req: LoadFromRemoteInstanceRequest, engine: Engine):
    """rollfleet extension: pull every weight from a seed, all or nothing for serving."""
    check_ports(engine, req.ports)
    source = SeedSource.of(engine.args, req.seed_host, req.seed_port, req.ports, req.group_name, req.backend)
    version = await load_from_seed(engine, source, req.timeout_s)
    return {"success": True, "message": f"loaded weights from {source.url}", "weight_version": version}
