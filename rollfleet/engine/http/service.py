"""The one object the HTTP routes drive: rank 0's engine (its launch args, model runner, lockstep
broadcaster, scheduler, tokenizer, call order and weight-update sessions), and how routes run
work on the engine thread and answer refusals.

Errors are HTTP 4xx with a JSON body `{"success": false, "message": ...}`; the server keeps serving.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any

import orjson
from fastapi import Depends, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from rollfleet.engine.lora.lora_recency import AdapterRecency
from rollfleet.engine.model.model import ModelRunner
from rollfleet.engine.runtime.memory_tags import ReleasedTags
from rollfleet.engine.runtime.scheduler import EngineStopped, Scheduler
from rollfleet.engine.sequences.sequence import Sequence
from rollfleet.engine.tp.lockstep import Lockstep
from rollfleet.engine.weights.call_order import CallOrder
from rollfleet.engine.weights.weight_groups import WeightUpdateError
from rollfleet.engine.weights.weight_session import SYNC_IN_PROGRESS, WeightSessions

VERSION = "0.1.0"


class BadRequest(Exception):
    def __init__(self, message: str, status_code: int = 400):
        super().__init__(message)
        self.message, self.status_code = message, status_code


def finite(value: Any) -> Any:
    """`value` with every NaN and infinite float replaced by None, as SGLang's answers (orjson) write them."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, (list, tuple)):
        return [finite(item) for item in value]
    if isinstance(value, dict):
        return {key: finite(item) for key, item in value.items()}
    return value


def dumps(content: Any) -> bytes:
    """JSON of an answer, as SGLang's server writes it (orjson): NaN and infinities (logprobs or
    weights of a model pushed NaN weights) as null, since JSON has no such numbers. orjson writes
    512 answers of 256 logprobs in 10 ms, json.dumps in 180 ms (on the event loop: every other
    request waits). What orjson refuses (an integer past 64 bits, a lone surrogate) goes the slow way,
    written as ASCII (a lone surrogate as its escape: no UTF-8 has it)."""
    try:
        return orjson.dumps(content, option=orjson.OPT_NON_STR_KEYS)
    except orjson.JSONEncodeError:
        return json.dumps(finite(content), allow_nan=False, separators=(",", ":")).encode()


class Answer(JSONResponse):
    """A JSON answer (results, weights) that may hold non-finite floats (`dumps`)."""

    def render(self, content: Any) -> bytes:
        return dumps(content)


def fail(message: str, status_code: int = 400) -> JSONResponse:
    return JSONResponse({"success": False, "message": message}, status_code=status_code)


def validation_message(exc: ValidationError | RequestValidationError) -> str:
    parts = []
    for error in exc.errors():
        if error.get("type") == "json_invalid":  # FastAPI's: loc is ("body", character offset)
            offset, why = error.get("loc", (None, None))[-1], (error.get("ctx") or {}).get("error", "")
            parts.append(f"the body is not valid JSON (at character {offset}: {why}): send one JSON object")
            continue
        where = ".".join(str(x) for x in error.get("loc", ()) if x != "body")
        parts.append(f"{where or 'body'}: {error.get('msg')} (got {error.get('input')!r})"[:300])
    return "; ".join(parts)


@dataclass
class RemoteTransfers:
    """R-Fork state of this engine (rank 0): as a seed, the one destination it serves at a time;
    as a destination, how its last load from a seed went (reported in /get_server_info)."""

    serving: str | None = None  # the destination's group_name while a transfer is open
    stage: str | None = None  # "joining", "joined" (waiting for the send call), "sending"
    expiry: asyncio.Task | None = None  # drops a joined group whose send never comes
    last_load: dict | None = None  # {"seed", "status": loading|loaded|failed, "reason", "weight_version"}

    def end_serving(self) -> None:
        if self.expiry is not None and self.expiry is not asyncio.current_task():
            self.expiry.cancel()
        self.serving = self.stage = self.expiry = None

    def report(self) -> dict:
        return {"seed": {"serving": self.serving, "stage": self.stage}, "last_load": self.last_load}


@dataclass
class EngineService:
    args: argparse.Namespace
    runner: ModelRunner  # rank 0's; routes read its state (readiness, adapters, dtype), never call it
    lockstep: Lockstep  # every model action goes through it, on the engine thread
    scheduler: Scheduler
    tokenizer: Any
    call_order: CallOrder = field(default_factory=CallOrder)
    unloading: set[str] = field(default_factory=set)  # adapters being unloaded: new requests refused
    lora_recency: AdapterRecency = field(default_factory=AdapterRecency)  # which adapter is evicted first
    lora_lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # LoRA loads and unloads, one at a time
    loaded_from: str | None = None  # the model path of the last disk update (None: the start's)
    start_breakdown: dict = field(default_factory=dict)  # start_timing.StartTimer.breakdown(), once listening
    sessions: WeightSessions = field(init=False)
    remote: RemoteTransfers = field(default_factory=RemoteTransfers)
    memory_tags: ReleasedTags = field(default_factory=ReleasedTags)  # released tags, as SGLang 0.5.23 records them

    def __post_init__(self):
        self.sessions = WeightSessions(
            self.scheduler,
            self.runner.schema.required_names,
            allow_partial=self.args.rollfleet_partial_weight_updates,
        )

    @property
    def model_path(self) -> str:
        return self.loaded_from or self.args.model_path

    @property
    def served_model_name(self) -> str:
        """The model's name in the OpenAI routes (SGLang's --served-model-name, default the path)."""
        return self.args.served_model_name or self.args.model_path

    @property
    def context_length(self) -> int:
        return self.scheduler.context_length

    async def control(
        self,
        fn: Callable[[], Any],
        *,
        needs_idle: bool = True,
        abort_first: bool = False,
        waits_for: Callable[[Sequence], bool] | None = None,
        queued=None,
    ) -> Any:
        """Run `fn` on the engine thread; `queued`: an async context held while it is queued (a turn).
        A refusal (a ValueError) becomes a BadRequest (HTTP 400); a stopped engine loop, HTTP 503."""
        try:
            async with queued or contextlib.nullcontext():
                future = self.scheduler.control(fn, needs_idle=needs_idle, abort_first=abort_first, waits_for=waits_for)
            return await asyncio.wrap_future(future)
        except (WeightUpdateError, ValueError) as exc:
            raise BadRequest(str(exc)) from exc
        except EngineStopped as exc:
            raise BadRequest(str(exc), 503) from exc

    def refusal(self) -> BadRequest | None:
        """Why a generate request is refused now, if it is."""
        if self.scheduler.failure is not None:
            return BadRequest(f"the engine loop has stopped: {self.scheduler.failure!r}", 503)
        if not self.runner.weights_ready:
            load = self.remote.last_load or {}
            why = (
                f"loading them from the seed {load.get('seed')} failed: {load.get('reason')}"
                if load.get("status") == "failed"
                else "started with --load-format dummy, or released"
            )
            return BadRequest(
                f"weights are not loaded ({why}): push weights with "
                "/update_weights_from_disk (or another update route) first",
                503,  # the server is not ready, the request is fine: a router may send it elsewhere
            )
        if self.sessions.mixed is not None:
            return BadRequest(self.sessions.mixed, 503)
        if "kv_cache" in self.memory_tags.released:  # a step would write a freed pool (tp > 1: a rank lost)
            return BadRequest(
                "the KV cache is released: call /resume_memory_occupation with tags ['kv_cache'] first", 503
            )
        return None

    def not_serving_reason(self) -> str | None:
        """Why `/health_generate` answers 503, if it does."""
        refusal = self.refusal()
        if refusal is not None:
            return refusal.message
        if self.scheduler.held is not None:
            return SYNC_IN_PROGRESS
        return "generation is paused" if self.scheduler.paused else None

    @property
    def weights_ready(self) -> bool:
        """The weights are complete and may be served (not mixed, no sync in progress)."""
        return self.runner.weights_ready and self.sessions.mixed is None and self.scheduler.held is None

    def loaded_adapters(self) -> dict[str, str]:
        return {name: adapter.path for name, adapter in list(self.runner.lora.adapters.items())}

    def kv_report(self) -> dict:
        """Which KV cache serves (paged or dense) and, paged, its pages and CUDA graphs now."""
        paged = self.runner.paged
        if paged is None:
            return {"layout": "dense", "memory_saver": False}
        blocks, graphs = self.scheduler.batches.blocks, paged.graphs
        report = {"layout": "paged", "page_size": paged.page_size, "pages": blocks.usable}
        report["memory_saver"] = paged.saver is not None  # kv_cache and cuda_graph pause in place (kv/saver.py)
        report.update(free_pages=len(blocks.free), cached_pages=len(blocks.hash_of), epoch=paged.pool.epoch)
        if graphs is not None:
            report["cuda_graphs"] = {"captured": len(graphs.graphs), "captures": graphs.captures}
            report["cuda_graphs"].update(capture_s=round(graphs.capture_s, 3), disabled=graphs.disabled)
            report["cuda_graphs"]["paused"] = graphs.paused  # cuda_graph released with the saver: decode runs eagerly
            # decode graphs with the kernel's prefix pass (rows sharing >= this many keys, kv/prefix_groups.py)
            report["cuda_graphs"]["prefix_pass"] = sum(1 for key in graphs.graphs if key[2])
            report["cuda_graphs"]["shared_prefix_keys"] = graphs.shared_prefix_keys if graphs.groups else 0
            if not paged.decode_graphs:
                report["cuda_graphs"]["disabled"] = "--disable-decode-cuda-graph"
        if (prefill := paged.prefill_graphs) is not None:  # small prefills' graphs (kv/prefill_graphs.py)
            report["prefill_graphs"] = {"captured": len(prefill.graphs), "captures": prefill.captures}
            report["prefill_graphs"].update(capture_s=round(prefill.capture_s, 3), replays=prefill.replays)
            report["prefill_graphs"]["disabled"] = prefill.disabled
        return report

    def not_one_per_rank(self, payloads: list[str]) -> str | None:
        if len(payloads) == self.args.tp_size:
            return None
        return (
            f"serialized_named_tensors has {len(payloads)} entries, this engine has tp_size={self.args.tp_size}: "
            "give one payload per tp rank (rank i reads entry i)"
        )


async def service_of(request: Request) -> EngineService:
    """The app's engine, for every route (`Engine`). A coroutine: FastAPI runs a plain function
    dependency in its thread pool, a hop to a worker thread and back for every request."""
    return request.app.state.engine


Engine = Annotated[EngineService, Depends(service_of)]
