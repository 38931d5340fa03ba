"""Generation routes: /generate, /health, /health_generate."""

from __future__ import annotations

import asyncio
from collections import Counter

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import ValidationError

from rollfleet.engine.http.service import Answer, BadRequest, Engine, EngineService, fail, validation_message
from rollfleet.engine.http.streaming import answers, stream_response
from rollfleet.engine.lora.lora_merge import LORA_OFF
from rollfleet.engine.runtime.admission import unserved
from rollfleet.engine.runtime.arrivals import mark_queued
from rollfleet.engine.sequences.logprobs import LogprobAsk
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
    for index, item in enumerate(raw_list):
        if why := unserved(item, "sampling_params." if not isinstance(raw, list) else f"sampling_params[{index}]."):
            raise BadRequest(why)
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
    engine.lora_recency.used(names)  # SGLang's LRU order: every request naming an adapter uses it
    return names


def rids_of(engine: EngineService, req: GenerateRequest, params: list[SamplingParams], is_batch: bool) -> list:
    """The rid of each prompt (None: one is made up); each sample's rid (`rid`, or `rid-i` when n > 1)
    must be unique among the unfinished requests, as SGLang requires, or an abort would hit others."""
    count = len(params)
    rids = req.rid if isinstance(req.rid, list) else [req.rid] * count
    if len(rids) != count:
        raise BadRequest(f"rid has {len(rids)} entries for {count} prompts")
    if is_batch and isinstance(req.rid, str):
        rids = [f"{req.rid}-{i}" for i in range(count)]
    samples = [r if p.n == 1 else f"{r}-{i}" for r, p in zip(rids, params) if r is not None for i in range(p.n)]
    if not samples:  # no rid given (the usual request): each sample gets a fresh one, nothing to check
        return rids
    taken = engine.scheduler.unfinished_rids()  # a set of every unfinished sample's rid, under the engine's lock
    twice = sorted(r for r, n in Counter(samples).items() if n > 1 or r in taken)
    if twice:
        where = "is used by an unfinished request" if twice[0] in taken else "names two samples of this request"
        raise BadRequest(
            f"rid {twice[0]!r} {where} (SGLang refuses a duplicate request ID): give each request (and each "
            "prompt of a batch) its own rid, or omit rid"
        )
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
async def generate(req: GenerateRequest, engine: Engine, request: Request):
    seqs, is_batch = await submit_generate(engine, req)
    if req.stream:
        return stream_response(engine, seqs, is_batch or len(seqs) > 1)
    results = await answers(engine, request, seqs)
    # json.dumps, not FastAPI's encoder: that walks every result in Python on the event loop (0.1 s for 1024)
    return Answer(results if is_batch or len(results) > 1 else results[0])


async def submit_generate(engine: EngineService, req: GenerateRequest) -> tuple[list, bool]:
    """Check a /generate request (400 naming field, value and fix) and queue its samples, grouped by
    prompt; also whether it was a batch. The OpenAI routes submit through here too. Queued or
    refused, the request no longer holds an idle engine back (runtime/arrivals.py)."""
    try:
        return await _check_and_submit(engine, req)
    finally:
        mark_queued()


async def _check_and_submit(engine: EngineService, req: GenerateRequest) -> tuple[list, bool]:
    refusal = engine.refusal()
    if refusal is not None:
        raise refusal
    if req.text is not None:  # long texts tokenize off the event loop; token ids need no thread hop
        prompts, is_batch = await asyncio.to_thread(prompts_of, engine, req)
    else:
        prompts, is_batch = prompts_of(engine, req)
    params = sampling_of(req, len(prompts))
    lora_names = lora_names_of(engine, req, len(prompts))
    try:
        engine.scheduler.check_request(prompts, params, "text" if req.text is not None else "input_ids")
    except ValueError as exc:
        raise BadRequest(str(exc)) from exc
    check_prompts(engine, prompts)
    ask = logprob_ask(engine, req, prompts)
    routes_start = routes_start_of(engine, req, prompts)
    rids = rids_of(engine, req, params, is_batch)
    try:  # no await between the adapter check above and this submission: an unload cannot slip in
        with engine.scheduler.submitting():
            seqs = _submit_all(engine, req, prompts, params, rids, lora_names, ask, routes_start)
    except RuntimeError as exc:
        raise BadRequest(str(exc), 503) from exc
    return seqs, is_batch


def _submit_all(engine, req, prompts, params, rids, lora_names, ask, routes_start) -> list:
    return [
        seq
        for prompt, p, rid, lora_name in zip(prompts, params, rids, lora_names)
        for seq in engine.scheduler.submit(
            prompt,
            p,
            rid=rid,
            return_logprob=req.return_logprob,
            lora_name=lora_name,
            ask=ask,
            routes_start=routes_start,
        )
    ]


# Input logprobs make a prefill return [batch, positions, vocab] float32 logits: bound one request's share
MAX_INPUT_LOGPROB_VALUES = 2**26


def logprob_ask(engine: EngineService, req: GenerateRequest, prompts: list[list[int]]) -> LogprobAsk | None:
    """The logprobs asked beyond the output tokens' (None: none), checked against the prompts and the
    vocabulary; SGLang ignores them without return_logprob."""
    if not req.return_logprob:
        return None
    vocab = engine.scheduler.vocab_size
    bad = [t for t in req.token_ids_logprob or [] if not 0 <= t < vocab]
    if bad:
        raise BadRequest(f"token_ids_logprob holds {bad[:5]}, outside this model's vocabulary [0, {vocab}): drop them")
    shortest = min(len(p) for p in prompts)
    if req.logprob_start_len > shortest:
        raise BadRequest(
            f"logprob_start_len={req.logprob_start_len} is past the end of a prompt of {shortest} tokens: "
            "give at most the prompt's length (0 = every prompt token), or -1 for output logprobs only"
        )
    if req.logprob_start_len >= 0:
        values = sum(len(p) - req.logprob_start_len for p in prompts) * vocab
        if values > MAX_INPUT_LOGPROB_VALUES:
            raise BadRequest(
                f"logprob_start_len={req.logprob_start_len} asks for input logprobs over {values // vocab} prompt "
                f"positions of a {vocab}-token vocabulary, more than this server computes per request "
                f"({MAX_INPUT_LOGPROB_VALUES} values): raise logprob_start_len or send fewer prompts per request"
            )
    if req.return_logprob_values and req.return_text_in_logprobs:
        raise BadRequest(
            "return_logprob_values=true answers the output logprobs as values alone, without the tokens' "
            "texts that return_text_in_logprobs=true asks for: drop one of them"
        )
    token_ids = tuple(req.token_ids_logprob) if req.token_ids_logprob is not None else None
    return LogprobAsk(
        req.logprob_start_len, req.top_logprobs_num, token_ids, req.return_text_in_logprobs, req.return_logprob_values
    )


def routes_start_of(engine: EngineService, req: GenerateRequest, prompts: list[list[int]]) -> int | None:
    """routed_experts_start_len when the request asks for routed experts (None: it does not), checked
    as SGLang checks it (0 <= start <= the prompt's length). SGLang without --enable-return-routed-experts
    silently answers no routes; here that is a 400 naming the flag, since a replaying trainer needs them."""
    if not req.return_routed_experts:
        return None
    if not engine.args.enable_return_routed_experts:
        raise BadRequest(
            "return_routed_experts=true: this server was started without --enable-return-routed-experts "
            "(SGLang's flag): restart it with the flag, or drop return_routed_experts"
        )
    if not engine.runner.route_capture.available:
        raise BadRequest(
            f"return_routed_experts=true: {type(engine.runner.model).__name__} has no MoE router this engine "
            "can record (transformers' router_logits outputs): drop return_routed_experts"
        )
    start, shortest = req.routed_experts_start_len, min(len(p) for p in prompts)
    if not 0 <= start <= shortest:
        raise BadRequest(
            f"routed_experts_start_len={start} must be in [0, {shortest}] (the prompt's length): use 0 for "
            "every position, or at most the number of prompt tokens"
        )
    return start


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
