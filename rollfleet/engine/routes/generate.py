"""Generation routes: /generate, /health, /health_generate."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from rollfleet.engine.lora_merge import LORA_OFF
from rollfleet.engine.service import BadRequest, Engine, EngineService, fail, validation_message
from rollfleet.wire.protocol import GenerateRequest, SamplingParams

router = APIRouter()


def prompts_of(engine: EngineService, req: GenerateRequest) -> tuple[list[list[int]], bool]:
    """The token ids of every prompt, and whether the request is a batch."""
    if req.text is not None:
        texts = [req.text] if isinstance(req.text, str) else req.text
        return [engine.tokenizer.encode(t) for t in texts], not isinstance(req.text, str)
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
        raise BadRequest(f"invalid sampling_params: {validation_message(exc)}") from exc


def lora_names_of(engine: EngineService, req: GenerateRequest, count: int) -> list[str | None]:
    """The adapter of each prompt; every named one must be loaded (checked at submission)."""
    names = req.lora_path if isinstance(req.lora_path, list) else [req.lora_path] * count
    if len(names) != count:
        raise BadRequest(f"lora_path has {len(names)} entries for {count} prompts: give one per prompt")
    lora = engine.runner.lora
    for name in sorted({n for n in names if n is not None}):
        if lora.limits is None:
            raise BadRequest(f"lora_path={name!r}: {LORA_OFF}")
        if name in engine.unloading:
            raise BadRequest(f"lora_path={name!r}: the adapter is being unloaded; load it again first")
        if name not in lora.adapters:
            raise BadRequest(
                f"lora_path={name!r} is not a loaded LoRA adapter (loaded: "
                f"{sorted(lora.adapters)}): load it with /load_lora_adapter first, or "
                "omit lora_path for the base model"
            )
    return names


def rids_of(req: GenerateRequest, count: int, is_batch: bool) -> list[str | None]:
    rids = req.rid if isinstance(req.rid, list) else [req.rid] * count
    if len(rids) != count:
        raise BadRequest(f"rid has {len(rids)} entries for {count} prompts")
    if is_batch and isinstance(req.rid, str):
        rids = [f"{req.rid}-{i}" for i in range(count)]
    return rids


def check_prompts(engine: EngineService, prompts: list[list[int]]) -> None:
    for index, prompt in enumerate(prompts):
        if not prompt:
            raise BadRequest(f"prompt {index} is empty: give at least one token")
        if len(prompt) >= engine.context_length:
            raise BadRequest(
                f"prompt {index} has {len(prompt)} tokens, the context length is "
                f"{engine.context_length}: shorten the prompt"
            )


@router.post("/generate")
async def generate(req: GenerateRequest, engine: Engine):
    refusal = engine.refusal()
    if refusal is not None:
        raise refusal
    if req.return_logprob and req.logprob_start_len >= 0:
        raise BadRequest("logprob_start_len >= 0 (input logprobs) is not supported: send -1")
    prompts, is_batch = await asyncio.to_thread(prompts_of, engine, req)  # long texts tokenize off the event loop
    params = sampling_of(req, len(prompts))
    lora_names = lora_names_of(engine, req, len(prompts))
    try:
        engine.scheduler.check_request(prompts, params, "text" if req.text is not None else "input_ids")
    except ValueError as exc:
        raise BadRequest(str(exc)) from exc
    check_prompts(engine, prompts)
    rids = rids_of(req, len(prompts), is_batch)
    try:  # no await between the adapter check above and this submission: an unload cannot slip in
        seqs = [
            seq
            for prompt, p, rid, lora_name in zip(prompts, params, rids, lora_names)
            for seq in engine.scheduler.submit(
                prompt, p, rid=rid, return_logprob=req.return_logprob, lora_name=lora_name
            )
        ]
    except RuntimeError as exc:
        raise BadRequest(str(exc), 503) from exc
    results = await asyncio.gather(*(asyncio.wrap_future(seq.future) for seq in seqs))
    # json.dumps, not FastAPI's encoder: that walks every result in Python on the event loop (0.1 s for 1024)
    return JSONResponse(results if is_batch or len(results) > 1 else results[0])


@router.get("/health")
async def health(engine: Engine):
    if reason := engine.scheduler.dead_reason:  # a dead engine loop is not "up"
        return fail(reason, 503)
    return Response(status_code=200)


@router.get("/health_generate")
async def health_generate(engine: Engine):
    reason = engine.not_serving_reason()
    if reason:
        return fail(reason, 503)
    try:
        (seq,) = engine.scheduler.submit(
            [engine.tokenizer.eos_token_id or 0],
            SamplingParams(max_new_tokens=1, temperature=0),
            rid=None,
            return_logprob=False,
        )
    except RuntimeError as exc:  # refused since the check above (the weights became mixed)
        return fail(str(exc), 503)
    await asyncio.wrap_future(seq.future)
    return Response(status_code=200)
