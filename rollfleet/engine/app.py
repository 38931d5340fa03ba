"""HTTP routes of the embedded engine (SGLang's names, fields and response shapes).

Errors are HTTP 4xx with a JSON body `{"success": false, "message": ...}`; the server keeps serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import ValidationError

from rollfleet.engine.call_order import CallOrder, CallOrderError
from rollfleet.engine.runner import WeightUpdateError
from rollfleet.engine.scheduler import EngineStopped
from rollfleet.wire.buckets import dtype_name
from rollfleet.wire.protocol import (
    AbortRequest,
    DestroyWeightsUpdateGroupRequest,
    GenerateRequest,
    GetWeightsByNameRequest,
    InitWeightsUpdateGroupRequest,
    LoadLoraAdapterFromTensorsRequest,
    LoadLoraAdapterRequest,
    MemoryRequest,
    PauseGenerationRequest,
    SamplingParams,
    UnloadLoraAdapterRequest,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromDistributedRequest,
    UpdateWeightsFromTensorRequest,
    UpdateWeightVersionRequest,
    WeightsFingerprintRequest,
)

VERSION = "0.1.0"
ALL_MEMORY_TAGS = ["weights", "kv_cache"]
LORA_OFF = (
    "LoRA is off on this engine: start it with --enable-lora (and --max-lora-rank, --lora-target-modules as needed)"
)


class BadRequest(Exception):
    def __init__(self, message: str, status_code: int = 400):
        super().__init__(message)
        self.message, self.status_code = message, status_code


def _fail(message: str, status_code: int = 400) -> JSONResponse:
    return JSONResponse({"success": False, "message": message}, status_code=status_code)


def _validation_message(exc: ValidationError | RequestValidationError) -> str:
    parts = []
    for error in exc.errors():
        where = ".".join(str(x) for x in error.get("loc", ()) if x != "body")
        parts.append(f"{where or 'body'}: {error.get('msg')} (got {error.get('input')!r})"[:300])
    return "; ".join(parts)


def create_app(args, runner, scheduler, run_action, tokenizer) -> FastAPI:
    app = FastAPI(title="rollfleet embedded engine", version=VERSION)
    context_length = scheduler.context_length

    @app.middleware("http")
    async def require_api_key(request: Request, call_next):
        if args.api_key:
            given = request.headers.get("authorization", "")
            if not secrets.compare_digest(given.encode(), f"Bearer {args.api_key}".encode()):
                return _fail("missing or wrong API key: send 'Authorization: Bearer <key>'", 401)
        return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def on_invalid_request(_request, exc: RequestValidationError):
        return _fail(f"invalid request: {_validation_message(exc)}")

    @app.exception_handler(BadRequest)
    async def on_bad_request(_request, exc: BadRequest):
        return _fail(exc.message, exc.status_code)

    call_order = CallOrder()

    async def control(fn, *, needs_idle: bool = True, abort_first: bool = False, waits_for=None, queued=None) -> Any:
        """Run `fn` on the engine thread; `queued`: an async context held while it is queued (a turn)."""
        try:
            async with queued or contextlib.nullcontext():
                future = scheduler.control(fn, needs_idle=needs_idle, abort_first=abort_first, waits_for=waits_for)
            return await asyncio.wrap_future(future)
        except (WeightUpdateError, ValueError) as exc:
            raise BadRequest(str(exc)) from exc
        except EngineStopped as exc:
            raise BadRequest(str(exc), 503) from exc

    def not_ready_reason() -> str | None:
        if scheduler.failure is not None:
            return f"the engine loop has stopped: {scheduler.failure!r}"
        if not runner.weights_ready:
            return (
                "weights are not loaded (started with --load-format dummy, or released): push weights with "
                "/update_weights_from_disk (or another update route) first"
            )
        return None

    # ---- generation --------------------------------------------------------------------------
    def prompts_of(req: GenerateRequest) -> tuple[list[list[int]], bool]:
        if req.text is not None:
            texts = [req.text] if isinstance(req.text, str) else req.text
            return [tokenizer.encode(t) for t in texts], not isinstance(req.text, str)
        ids = req.input_ids
        if ids and isinstance(ids[0], list):
            return ids, True
        return [ids], False

    def sampling_of(req: GenerateRequest, count: int) -> list[SamplingParams]:
        raw = req.sampling_params if req.sampling_params is not None else {}
        if isinstance(raw, list) and len(raw) != count:
            raise BadRequest(f"sampling_params has {len(raw)} entries for {count} prompts: give one per prompt")
        raw_list = raw if isinstance(raw, list) else [raw] * count
        try:
            return [SamplingParams(**item) for item in raw_list]
        except ValidationError as exc:
            raise BadRequest(f"invalid sampling_params: {_validation_message(exc)}") from exc

    def lora_names_of(req: GenerateRequest, count: int) -> list[str | None]:
        """The adapter of each prompt; every named one must be loaded (checked at submission)."""
        names = req.lora_path if isinstance(req.lora_path, list) else [req.lora_path] * count
        if len(names) != count:
            raise BadRequest(f"lora_path has {len(names)} entries for {count} prompts: give one per prompt")
        for name in sorted({n for n in names if n is not None}):
            if runner.lora_limits is None:
                raise BadRequest(f"lora_path={name!r}: {LORA_OFF}")
            if name in unloading:
                raise BadRequest(f"lora_path={name!r}: the adapter is being unloaded; load it again first")
            if name not in runner.lora_adapters:
                raise BadRequest(
                    f"lora_path={name!r} is not a loaded LoRA adapter (loaded: "
                    f"{sorted(runner.lora_adapters)}): load it with /load_lora_adapter first, or "
                    "omit lora_path for the base model"
                )
        return names

    @app.post("/generate")
    async def generate(req: GenerateRequest):
        reason = not_ready_reason()
        if reason:
            raise BadRequest(reason)
        if req.return_logprob and req.logprob_start_len >= 0:
            raise BadRequest("logprob_start_len >= 0 (input logprobs) is not supported: send -1")
        prompts, is_batch = await asyncio.to_thread(prompts_of, req)  # long texts tokenize off the event loop
        params = sampling_of(req, len(prompts))
        lora_names = lora_names_of(req, len(prompts))
        try:
            scheduler.check_request(prompts, params, "text" if req.text is not None else "input_ids")
        except ValueError as exc:
            raise BadRequest(str(exc)) from exc
        for index, prompt in enumerate(prompts):
            if not prompt:
                raise BadRequest(f"prompt {index} is empty: give at least one token")
            if len(prompt) >= context_length:
                raise BadRequest(
                    f"prompt {index} has {len(prompt)} tokens, the context length is "
                    f"{context_length}: shorten the prompt"
                )
        rids = req.rid if isinstance(req.rid, list) else [req.rid] * len(prompts)
        if len(rids) != len(prompts):
            raise BadRequest(f"rid has {len(rids)} entries for {len(prompts)} prompts")
        if is_batch and isinstance(req.rid, str):
            rids = [f"{req.rid}-{i}" for i in range(len(prompts))]
        try:  # no await between the adapter check above and this submission: an unload cannot slip in
            seqs = [
                seq
                for prompt, p, rid, lora_name in zip(prompts, params, rids, lora_names)
                for seq in scheduler.submit(prompt, p, rid=rid, return_logprob=req.return_logprob, lora_name=lora_name)
            ]
        except RuntimeError as exc:
            raise BadRequest(str(exc), 503) from exc
        results = await asyncio.gather(*(asyncio.wrap_future(seq.future) for seq in seqs))
        # json.dumps, not FastAPI's encoder: that walks every result in Python on the event loop (0.1 s for 1024)
        return JSONResponse(results if is_batch or len(results) > 1 else results[0])

    @app.get("/health")
    async def health():
        if reason := scheduler.dead_reason:  # a dead engine loop is not "up"
            return _fail(reason, 503)
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate():
        reason = not_ready_reason() or ("generation is paused" if scheduler.paused else None)
        if reason:
            return _fail(reason, 503)
        (seq,) = scheduler.submit(
            [tokenizer.eos_token_id or 0],
            SamplingParams(max_new_tokens=1, temperature=0),
            rid=None,
            return_logprob=False,
        )
        await asyncio.wrap_future(seq.future)
        return Response(status_code=200)

    # ---- status ---------------------------------------------------------------------------------
    @app.get("/get_model_info")
    @app.get("/model_info")
    async def model_info():
        return {
            "model_path": args.model_path,
            "tokenizer_path": args.tokenizer_path or args.model_path,
            "is_generation": True,
            "weight_version": scheduler.weight_version,
            "weights_ready": runner.weights_ready,
            "context_length": context_length,
            "dtype": dtype_name(runner.dtype),
            "loaded_lora_adapters": loaded_adapters(),
        }

    @app.get("/get_server_info")
    @app.get("/server_info")
    async def server_info():
        info = {k: v for k, v in vars(args).items() if k != "api_key"}
        return {
            **info,
            "api_key_set": bool(args.api_key),
            "version": VERSION,
            "engine": "rollfleet-embedded",
            "weight_version": scheduler.weight_version,
            "weights_ready": runner.weights_ready,
            "scheduler_stats": dict(scheduler.stats),
            "loaded_lora_adapters": loaded_adapters(),
            "rollfleet_ordered_weight_calls": True,
        }

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        if scheduler.num_unfinished:
            return PlainTextResponse("Cache not flushed: requests are running.", status_code=400)
        return PlainTextResponse("Cache flushed (the embedded engine keeps no prefix cache).")

    # ---- weights --------------------------------------------------------------------------------
    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(req: UpdateWeightsFromDiskRequest):
        if req.load_format not in (None, "auto", "safetensors"):
            raise BadRequest(f"load_format={req.load_format!r}: the embedded engine reads safetensors only")

        def load():
            run_action("update_weights_from_disk", model_path=req.model_path)
            if req.weight_version is not None:
                scheduler.weight_version = req.weight_version

        try:
            await control(load, abort_first=req.abort_all_requests)
        except BadRequest as exc:
            return JSONResponse({"success": False, "message": exc.message, "num_paused_requests": 0}, 400)
        return {"success": True, "message": f"loaded weights from {req.model_path}", "num_paused_requests": 0}

    def update_then_set_version(action: str, weight_version: str | None, **kwargs):
        def run():
            run_action(action, **kwargs)
            if weight_version is not None:
                scheduler.weight_version = weight_version

        return run

    def not_one_per_rank(payloads: list[str]) -> str | None:
        if len(payloads) == args.tp_size:
            return None
        return (
            f"serialized_named_tensors has {len(payloads)} entries, this engine has tp_size={args.tp_size}: "
            "give one payload per tp rank (rank i reads entry i)"
        )

    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(req: UpdateWeightsFromTensorRequest):
        if problem := not_one_per_rank(req.serialized_named_tensors):
            raise BadRequest(problem)
        # The entries are small (shared-memory / CUDA IPC handles): every rank gets the whole list and
        # decodes only its own entry.
        await control(
            update_then_set_version(
                "update_weights_from_tensor",
                req.weight_version,
                serialized_named_tensors=req.serialized_named_tensors,
                load_format=req.load_format,
            ),
            abort_first=req.abort_all_requests,
        )
        return {"success": True, "message": "Succeeded to update model weights."}

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(req: InitWeightsUpdateGroupRequest):
        # Blocks the engine thread (not HTTP) until every rank joined or timeout_s passed; it needs no
        # idle engine, so a running batch pauses for the join at most.
        await control(
            lambda: run_action(
                "init_weights_update_group",
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

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(req: UpdateWeightsFromDistributedRequest):
        try:
            turn = call_order.turn(req.rollfleet_sync_id, req.rollfleet_call)
            await control(
                update_then_set_version(
                    "update_weights_from_distributed",
                    req.weight_version,
                    names=req.names,
                    dtypes=req.dtypes,
                    shapes=req.shapes,
                    group_name=req.group_name,
                    load_format=req.load_format,
                ),
                abort_first=req.abort_all_requests,
                queued=turn,
            )
        except CallOrderError as exc:
            raise BadRequest(str(exc)) from exc
        return {"success": True, "message": "Succeeded to update parameter online."}

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(req: DestroyWeightsUpdateGroupRequest):
        await control(lambda: run_action("destroy_weights_update_group", group_name=req.group_name), needs_idle=False)
        return {"success": True, "message": f"destroyed weight update group {req.group_name!r}"}

    @app.post("/update_weight_version")
    async def update_weight_version(req: UpdateWeightVersionRequest):
        def set_version():
            run_action("drop_held_payloads")  # a version marks the end of a sync
            scheduler.weight_version = req.new_version

        await control(set_version, abort_first=req.abort_all_requests)
        return {"success": True, "message": "weight version updated", "new_version": req.new_version}

    @app.api_route("/get_weights_by_name", methods=["GET", "POST"])
    async def get_weights_by_name(req: GetWeightsByNameRequest):
        return await control(
            lambda: run_action("get_weights_by_name", name=req.name, truncate_size=req.truncate_size), needs_idle=False
        )

    @app.get("/rollfleet/shard_fingerprints")
    async def shard_fingerprints():
        """rollfleet extension: sha256 of every tp rank's local shard of every parameter."""
        return await control(lambda: run_action("shard_fingerprints"), needs_idle=False)

    @app.post("/rollfleet/weights_fingerprint")
    async def weights_fingerprint(req: WeightsFingerprintRequest):
        """rollfleet extension: fingerprints of full tensors by checkpoint name (sync verification), or
        of a loaded LoRA adapter's tensors by peft key (`lora_name`)."""
        if req.lora_name is not None:
            return await control(
                lambda: run_action("lora_fingerprints", lora_name=req.lora_name, names=req.names, samples=req.samples),
                needs_idle=False,
            )
        return await control(
            lambda: run_action("weights_fingerprint", names=req.names, samples=req.samples), needs_idle=False
        )

    @app.get("/rollfleet/memory")
    async def memory():
        """rollfleet extension: memory per tp rank (weights; allocator and device figures on GPU)."""
        return await control(lambda: run_action("memory"), needs_idle=False)

    # ---- LoRA adapters ----------------------------------------------------------------------------
    # Loading only stores an adapter (the weights change when a batch asks for it), so it needs no
    # idle engine. Unloading waits until no unfinished request uses the adapter, and new requests
    # naming it are refused meanwhile.
    unloading: set[str] = set()

    def loaded_adapters() -> dict[str, str]:
        return {name: adapter.path for name, adapter in list(runner.lora_adapters.items())}

    def lora_reply(error: str | None = None):
        body = {"success": error is None, "error_message": error or "", "loaded_adapters": loaded_adapters()}
        return body if error is None else JSONResponse({**body, "message": error}, status_code=400)

    async def lora_control(fn, **kwargs):
        if runner.lora_limits is None:
            return lora_reply(LORA_OFF)
        try:
            await control(fn, **kwargs)
        except BadRequest as exc:
            return lora_reply(exc.message)
        return lora_reply()

    @app.post("/load_lora_adapter")
    async def load_lora_adapter(req: LoadLoraAdapterRequest):
        return await lora_control(
            lambda: run_action("load_lora_adapter", lora_name=req.lora_name, lora_path=req.lora_path), needs_idle=False
        )

    @app.post("/load_lora_adapter_from_tensors")
    async def load_lora_adapter_from_tensors(req: LoadLoraAdapterFromTensorsRequest):
        if problem := not_one_per_rank(req.serialized_named_tensors):
            return lora_reply(problem)
        return await lora_control(
            lambda: run_action(
                "load_lora_adapter",
                lora_name=req.lora_name,
                config_dict=req.config_dict,
                serialized_named_tensors=req.serialized_named_tensors,
                load_format=req.load_format,
            ),
            needs_idle=False,
        )

    @app.post("/unload_lora_adapter")
    async def unload_lora_adapter(req: UnloadLoraAdapterRequest):
        name = req.lora_name
        if runner.lora_limits is not None and name in runner.lora_adapters:
            unloading.add(name)
        try:
            return await lora_control(
                lambda: run_action("unload_lora_adapter", lora_name=name),
                needs_idle=False,
                waits_for=lambda seq: seq.lora_name == name,
            )
        finally:
            unloading.discard(name)

    # ---- memory ---------------------------------------------------------------------------------
    def memory_route(action: str):
        async def handler(req: MemoryRequest):
            tags = [t for t in (req.tags or ALL_MEMORY_TAGS) if t != "cuda_graph"]  # no CUDA graphs here

            def act():
                if scheduler.num_unfinished:
                    raise ValueError(
                        f"{scheduler.num_unfinished} requests are unfinished: pause or abort them "
                        "before releasing or resuming memory"
                    )
                return run_action(action, tags=tags)

            memory = await control(act)
            return {"success": True, "message": f"{action} {tags}", "memory": memory}

        return handler

    app.post("/release_memory_occupation")(memory_route("release_memory"))
    app.post("/resume_memory_occupation")(memory_route("resume_memory"))

    # ---- abort and pause ------------------------------------------------------------------------
    @app.post("/abort_request")
    async def abort_request(req: AbortRequest):
        if not req.rid and not req.abort_all:
            raise BadRequest("give rid or abort_all=true")
        count = scheduler.abort(req.rid, req.abort_all)
        return {"success": True, "message": f"aborted {count} requests"}

    @app.post("/pause_generation")
    async def pause_generation(req: PauseGenerationRequest):
        if req.mode == "retract":
            raise BadRequest("mode='retract' is not supported by the embedded engine: use 'abort' or 'in_place'")
        scheduler.pause(req.mode)
        return {"success": True, "message": f"generation paused ({req.mode})"}

    @app.post("/continue_generation")
    async def continue_generation():
        scheduler.resume()
        return {"success": True, "message": "generation continued"}

    return app
