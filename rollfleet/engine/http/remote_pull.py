"""The destination's side of R-Fork (rollfleet.wire.remote_instance): check the seed's layout, drive
its two routes while every tp rank joins and receives, and serve the seed's weight version.

Ordering: the layout (tp and ep size, dtype, every parameter's name, shape and dtype, in broadcast
order) is compared before any group exists, so a mismatch is refused before any broadcast. Then the
join and the seed's init run together, then the receive and the seed's send. From the first
received byte the weights are "not loaded"; they become loaded, at the seed's version, only when
every rank received everything. A failure at any step leaves the engine up but not serving
(generate 503 naming the reason, also in /get_server_info), never a half-received model under a
version; a later push or disk load makes it ready. Unlike SGLang, whose start fails, an engine
started with `--load-format remote_instance` comes up even when the seed fails it.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from dataclasses import dataclass

from rollfleet.engine.http.service import BadRequest, EngineService
from rollfleet.engine.tp.lockstep import Action
from rollfleet.engine.weights.weight_groups import WeightUpdateError
from rollfleet.wire.buckets import dtype_name
from rollfleet.wire.client import EngineClient, EngineError, EngineUnreachable
from rollfleet.wire.remote_instance import LAYOUT_ROUTE, destination_group_name, format_ports

log = logging.getLogger("rollfleet.engine")


class RemoteLoadError(RuntimeError):
    pass


@dataclass(frozen=True)
class SeedSource:
    host: str
    port: int
    ports: str  # "p0,p1": one group port per tp rank, served by the seed's host
    group_name: str
    backend: str

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @classmethod
    def of(cls, args: argparse.Namespace, host: str, port: int, ports, group_name=None, backend=None) -> SeedSource:
        """Defaults as SGLang's destination picks them (group `send_weights_<host>`; nccl on GPU, gloo on CPU)."""
        backend = backend or ("nccl" if args.device == "cuda" else "gloo")
        return cls(host, port, format_ports(ports), group_name or destination_group_name(args.host), backend)


def layout_mismatch(engine: EngineService, layout: dict) -> str | None:
    """Why this engine cannot receive from a seed of `layout` (None: it can)."""
    if layout.get("engine") != "rollfleet-embedded":
        return f"the seed is not an embedded engine ({layout.get('engine')!r}): its parameters differ"
    mine = {"tp_size": engine.args.tp_size, "ep_size": engine.args.ep_size, "dtype": dtype_name(engine.runner.dtype)}
    problems = [
        f"{key}: seed {layout.get(key)!r}, this engine {value!r}"
        for key, value in mine.items()
        if layout.get(key) != value
    ]
    if not layout.get("weights_ready"):
        problems.append("the seed does not serve (its weights are not loaded or not complete)")
    if layout.get("serving_destination") is not None:
        problems.append(f"busy: the seed serves destination {layout['serving_destination']!r}; one at a time")
    theirs = {name: (shape, dtype) for name, shape, dtype in layout.get("parameters", [])}
    ours = {name: (shape, dtype) for name, shape, dtype in engine.runner.remote.layout()}
    differ = [
        f"{n}: seed {theirs.get(n)}, this engine {ours.get(n)}"
        for n in sorted(set(ours) | set(theirs))
        if ours.get(n) != theirs.get(n)
    ]
    if differ:
        problems.append(f"{len(differ)} parameters differ ({'; '.join(differ[:5])}{' ...' if len(differ) > 5 else ''})")
    elif [p[0] for p in layout.get("parameters", [])] != [p[0] for p in engine.runner.remote.layout()]:
        problems.append("the parameters are in another order")
    return "; ".join(problems) or None


class Laps:
    """Seconds of each step of a sequence, into `into` as each ends."""

    def __init__(self, into: dict[str, float]):
        self.into, self.began = into, time.perf_counter()

    def done(self, step: str) -> None:
        now = time.perf_counter()
        self.into[step], self.began = round(now - self.began, 4), now


async def load_from_seed(engine: EngineService, source: SeedSource, timeout_s: float) -> str:
    """Pull every weight from `source`; the seed's weight version. BadRequest naming why it failed."""
    if engine.sessions.open is not None:
        raise BadRequest("a weight-update session is open: end it (/end_weight_update) before loading from a seed")
    if (engine.remote.last_load or {}).get("status") == "loading":
        raise BadRequest(f"busy: already loading from {engine.remote.last_load['seed']}", 409)
    engine.remote.last_load = load = {"seed": source.url, "status": "loading", "reason": None, "weight_version": None}
    start, load["phases"] = time.perf_counter(), {}
    try:
        version = await _pull(engine, source, timeout_s, load["phases"])
    except (RemoteLoadError, BadRequest, EngineError, EngineUnreachable) as exc:
        load.update(status="failed", reason=getattr(exc, "message", None) or f"{type(exc).__name__}: {exc}")
        log.error("R-Fork: loading weights from %s failed: %s", source.url, load["reason"])
        state = "weights not loaded" if not engine.runner.weights_ready else "weights unchanged"
        raise BadRequest(f"loading weights from the seed {source.url} failed ({state}): {load['reason']}") from exc
    load.update(status="loaded", weight_version=version, seconds=round(time.perf_counter() - start, 3))
    log.warning("R-Fork: loaded weights (version %r) from %s in %.2f s", version, source.url, load["seconds"])
    return version


async def _pull(engine: EngineService, source: SeedSource, timeout_s: float, phases: dict[str, float]) -> str:
    """The pull's steps; `phases` gets the seconds of each one done (layout, join, transfer, check)."""
    done = Laps(phases).done
    async with EngineClient(
        source.url, api_key=engine.args.api_key, admin_api_key=engine.args.admin_api_key, timeout=timeout_s
    ) as seed:
        try:
            layout = await seed.weight_layout()
        except EngineError as exc:
            if exc.status_code == 404:
                raise RemoteLoadError(
                    f"the seed has no {LAYOUT_ROUTE} (an SGLang server?): load from an embedded seed"
                ) from exc
            raise
        if problem := layout_mismatch(engine, layout):
            raise RemoteLoadError(f"refused before any broadcast: {problem}")
        done("layout")
        version, group = layout["weight_version"], {"ports": source.ports, "group_name": source.group_name}
        join = engine.control(
            lambda: engine.lockstep(
                Action.REMOTE_INSTANCE_JOIN,
                master_address=source.host,
                group_rank=1,
                backend=source.backend,
                timeout_s=timeout_s,
                **group,
            ),
            needs_idle=False,
        )
        init = seed.init_weights_send_group_for_remote_instance(
            source.host, source.ports, group_name=source.group_name, backend=source.backend
        )
        if isinstance(await _alongside(join, init, "join", "the seed's init", timeout_s), BaseException):
            await engine.control(lambda: engine.lockstep(Action.REMOTE_INSTANCE_DESTROY, **group), needs_idle=False)
            raise RemoteLoadError("the seed's init failed after this engine joined; its group is destroyed")
        done("join")

        def receive():
            try:
                names = engine.lockstep(Action.REMOTE_INSTANCE_RECEIVE, **group)
            except WeightUpdateError as exc:
                engine.sessions.refuse_serving(
                    f"the weights are not loaded: receiving them from {source.url} failed: {exc}"
                )
                raise
            engine.sessions.after_update(names, version)

        send = seed.send_weights_to_remote_instance(source.host, source.ports, group_name=source.group_name)
        sent = await _alongside(engine.control(receive), send, "receive", "the seed's send", timeout_s)
        if isinstance(sent, BaseException):  # every byte arrived: only the seed's answer is missing
            log.warning("R-Fork: received everything, but the seed's send call failed: %s", sent)
        done("transfer")
        after = (await seed.get_model_info())["weight_version"]
        done("check")
    if after != version:
        reason = f"the seed's weight_version changed from {version!r} to {after!r} during the transfer: load again"
        await engine.control(lambda: engine.sessions.refuse_serving(reason), needs_idle=False)
        raise RemoteLoadError(reason)
    return version


async def _alongside(local, remote, local_step: str, remote_step: str, timeout_s: float):
    """Run this engine's step (on its engine thread, bounded by the group's timeout) while the seed's
    call runs; the seed's answer, or its exception. When the local step fails, the seed's call is
    not awaited further (a stopped seed would hold it): RemoteLoadError naming both."""
    call = asyncio.ensure_future(remote)
    try:
        await local
    except (BadRequest, RuntimeError) as exc:
        seed_said = call.exception() if call.done() and not call.cancelled() else None
        call.cancel()
        reasons = [f"{local_step}: {getattr(exc, 'message', None) or exc}"]
        reasons += [f"{remote_step}: {getattr(seed_said, 'message', None) or seed_said}"] if seed_said else []
        raise RemoteLoadError("; ".join(reasons)) from exc
    try:
        return await asyncio.wait_for(call, timeout_s)
    except (TimeoutError, EngineError, EngineUnreachable) as exc:
        return exc


def load_at_start(engine: EngineService) -> None:
    """`--load-format remote_instance`: pull before the server answers /health. A failure is logged and
    reported; the engine still comes up, not ready."""
    args = engine.args
    source = SeedSource.of(
        args,
        args.remote_instance_weight_loader_seed_instance_ip,
        args.remote_instance_weight_loader_seed_instance_service_port,
        args.remote_instance_weight_loader_send_weights_group_ports,
    )
    try:
        asyncio.run(load_from_seed(engine, source, args.rollfleet_remote_instance_timeout_s))
    except BadRequest as exc:
        log.error("%s; serving nothing until weights are pushed or loaded from disk", exc.message)
