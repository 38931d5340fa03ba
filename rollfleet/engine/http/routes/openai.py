"""OpenAI-compatible routes as SGLang serves them: /v1/completions, /v1/chat/completions (answers
or `stream: true` chunks, `stream_options.include_usage`), /v1/models, /v1/loads. Requests go
through /generate's checks and queue (routes/generate.py: submit_generate); errors are OpenAI's
error object with a 4xx status."""

from __future__ import annotations

import asyncio
import functools
import pathlib
from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from jinja2 import TemplateError  # transformers renders chat templates with jinja2

from rollfleet.engine.http.openai_api import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    chat_logprobs,
    completion_logprobs,
    envelope,
    error_body,
    finish_fields,
    usage,
    weight_version_metadata,
)
from rollfleet.engine.http.routes.generate import submit_generate
from rollfleet.engine.http.service import VERSION, Answer, BadRequest, Engine, EngineService
from rollfleet.engine.http.streaming import DONE, progress, sse
from rollfleet.engine.http.streaming import answers as answers_of

router = APIRouter()


def openai_error(exc: BadRequest) -> JSONResponse:
    return JSONResponse(error_body(exc.message, exc.status_code), status_code=exc.status_code)


@router.post("/v1/completions")
async def completions(req: CompletionRequest, engine: Engine, request: Request):
    try:
        seqs, _ = await submit_generate(engine, req.generate_request())
    except BadRequest as exc:
        return openai_error(exc)
    model, with_logprobs = req.model, req.logprobs is not None
    if req.stream:
        return _stream(engine, seqs, req, "text_completion", lambda meta, at: _text_choice(meta, at, with_logprobs))
    answers = await answers_of(engine, request, seqs)
    choices = [
        {"index": i, "text": a["text"], **_text_choice(a["meta_info"], 0, with_logprobs)} for i, a in enumerate(answers)
    ]
    body = {**envelope("text_completion", answers[0]["meta_info"]["id"], model), "choices": choices}
    return Answer(_with_extensions({**body, "usage": usage(answers, req.n)}, req, answers))


@router.post("/v1/chat/completions")
async def chat_completions(req: ChatCompletionRequest, engine: Engine, request: Request):
    try:
        input_ids = await asyncio.to_thread(chat_prompt, engine, req)
        seqs, _ = await submit_generate(engine, req.generate_request(input_ids))
    except BadRequest as exc:
        return openai_error(exc)
    if req.stream:
        return _stream(engine, seqs, req, "chat.completion.chunk", lambda meta, start: _chat_extra(meta, start, req))
    answers = await answers_of(engine, request, seqs)
    choices = [
        {
            "index": i,
            "message": {"role": "assistant", "content": a["text"], "reasoning_content": None, "tool_calls": None},
            **_chat_extra(a["meta_info"], 0, req),
            **req.token_id_fields(input_ids, a),
        }
        for i, a in enumerate(answers)
    ]
    body = {**envelope("chat.completion", answers[0]["meta_info"]["id"], req.model), "choices": choices}
    return Answer(_with_extensions({**body, "usage": usage(answers, req.n)}, req, answers))


def _with_extensions(body: dict, req, answers: list[dict]) -> dict:
    """SGLang's additions to a non-streamed answer, both from the first /generate answer: `metadata`
    (weight version and spans) always, `sglext` (routed experts) when asked and present."""
    first = answers[0]["meta_info"]
    body["metadata"] = weight_version_metadata(first)
    if (extension := req.sglext([first])) is not None:
        body["sglext"] = extension
    return body


def _text_choice(meta: dict, start: int, with_logprobs: bool) -> dict[str, Any]:
    return {"logprobs": completion_logprobs(meta, start) if with_logprobs else None, **finish_fields(meta)}


def _chat_extra(meta: dict, start: int, req: ChatCompletionRequest) -> dict[str, Any]:
    return {"logprobs": chat_logprobs(meta, start) if req.logprobs else None, **finish_fields(meta)}


def chat_prompt(engine: EngineService, req: ChatCompletionRequest) -> list[int]:
    """The prompt's token ids: the messages (and tools) through the chat template (--chat-template,
    else the tokenizer's own), then tokenized without adding special tokens (the template has them).
    Tools a template does not render are refused: dropping them silently answers another question."""
    template = _read_template(engine.args.chat_template) if engine.args.chat_template else None
    if template is None and not getattr(engine.tokenizer, "chat_template", None):
        raise BadRequest(
            "this model's tokenizer has no chat template: start the server with --chat-template FILE "
            "(a Jinja template), or send /v1/completions with the prompt already formatted"
        )
    try:
        messages = [message.as_template_input() for message in req.messages]
    except ValueError as exc:  # content parts other than text
        raise BadRequest(f"messages: {exc}") from exc
    tools = req.template_tools()
    text = _render_with_tools(functools.partial(_render, engine.tokenizer, messages, template, req), tools)
    if tools is not None and text == _render(engine.tokenizer, messages, template, req, None):
        raise BadRequest(
            f"tools: the chat template renders the same prompt without the {len(tools)} tools (it has no tools "
            "section): start the server with a --chat-template that renders `tools`, send tool_choice 'none', "
            "or describe the tools in the messages"
        )
    return engine.tokenizer.encode(text, add_special_tokens=False)


def _render_with_tools(render, tools: list[dict] | None) -> str:
    """`render(tools)`; when the template fails on OpenAI's tool shape, SGLang's second try: the
    functions without their wrapper (some templates, Mistral's, take them so)."""
    try:
        return render(tools)
    except BadRequest:
        if not tools:
            raise
        return render([tool["function"] for tool in tools])


def _render(tokenizer, messages: list[dict], template: str | None, req: ChatCompletionRequest, tools) -> str:
    try:
        return tokenizer.apply_chat_template(
            messages,
            tools=tools,
            tokenize=False,
            chat_template=template,
            add_generation_prompt=not req.continue_final_message,
            continue_final_message=req.continue_final_message,
            **(req.chat_template_kwargs or {}),
        )
    except (ValueError, TypeError, TemplateError) as exc:  # the template's own errors (raise_exception, ...)
        raise BadRequest(f"messages: the chat template failed on them: {exc}") from exc


@functools.lru_cache(maxsize=4)
def _read_template(path: str) -> str:
    return pathlib.Path(path).read_text()


def _stream(engine: EngineService, seqs, req, kind: str, extra) -> StreamingResponse:
    """OpenAI chunks: per token of each choice the new text (chat: a first chunk with the role;
    a token that settles no new text sends no chunk, as SGLang), the last one with finish_reason;
    the texts add up to the answer's text (streaming.progress). Then, as SGLang, a chunk with no
    choices carrying `sglext` (routed experts, when asked); with stream_options.include_usage a
    last chunk of counts."""
    head = envelope(kind, seqs[0].rid, req.model)
    chat = kind == "chat.completion.chunk"

    async def events():
        sent_tokens, answers = {}, {}
        if chat:
            for index in range(len(seqs)):
                first = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None}
                yield sse({**head, "choices": [{**first, "finish_reason": None}]})
        async for index, answer, new_text, finished in progress(engine, seqs):
            if not new_text and not finished:
                continue  # nothing settled yet (SGLang sends no empty delta): its logprobs go with the next chunk
            start, sent_tokens[index] = sent_tokens.get(index, 0), len(answer["output_ids"])
            choice = {"index": index, **extra(answer["meta_info"], start)}
            if chat:
                choice["delta"] = {"content": new_text} if new_text or not finished else {}
            else:
                choice["text"] = new_text
            yield sse({**head, "choices": [choice]})
            if finished:
                answers[index] = answer
        if (extension := req.sglext([answers[i]["meta_info"] for i in sorted(answers)])) is not None:
            yield sse({**head, "choices": [], "sglext": extension})  # after the choices, before usage
        if req.stream_options is not None and req.stream_options.include_usage:
            ordered = [answers[i] for i in range(len(seqs))]
            yield sse({**head, "choices": [], "usage": usage(ordered, req.n)})
        yield DONE

    return StreamingResponse(events(), media_type="text/event-stream")


@router.get("/v1/models")
async def models(engine: Engine):
    """The served model and every loaded LoRA adapter (parent: the model), as SGLang lists them."""
    name = engine.served_model_name
    cards = [ModelCard(id=name, root=name, max_model_len=engine.context_length)]
    cards += [ModelCard(id=lora, root=path, parent=name) for lora, path in engine.loaded_adapters().items()]
    return {"object": "list", "data": [card.model_dump() for card in cards]}


@router.get("/v1/loads")
async def loads(engine: Engine):
    """SGLang's load report (one entry: the embedded engine has no data-parallel ranks)."""
    stats = engine.scheduler.live_stats
    capacity = engine.args.max_running_requests
    load = {
        "dp_rank": 0,
        "num_running_reqs": stats["running_requests"],
        "num_waiting_reqs": stats["waiting_requests"],
        "max_running_requests": capacity,
        "max_total_num_tokens": engine.args.max_total_tokens or capacity * engine.context_length,
        "utilization": stats["running_requests"] / capacity,
    }
    return {
        "timestamp": datetime.now(UTC).isoformat(),
        "version": VERSION,
        "accelerator": None,
        "num_accelerators": engine.args.tp_size,
        "loads": [load],
    }
