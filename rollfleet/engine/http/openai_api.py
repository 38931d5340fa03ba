"""OpenAI-compatible request models and answers, as SGLang serves them (its entrypoints/openai
protocol, serving_completions and serving_chat): each request becomes one /generate request, each
/generate answer one choice.

SGLang's extra fields that RL frameworks send are taken: `top_k`, `min_p`, `min_tokens`,
`stop_token_ids`, `no_stop_trim`, `ignore_eos`, `skip_special_tokens`, `repetition_penalty`,
`lora_path`, `rid`, `return_text_in_logprobs`, `chat_template_kwargs`, `return_routed_experts` and
`routed_experts_start_len`; `separate_reasoning` and other fields this engine has no use for are
ignored (no reasoning parser: `reasoning_content` is null). Chat `tools` go into the chat template
and `tool_choice` "auto" / "none" is followed, as SGLang without a tool-call parser (chat_tools.py);
messages keep `tool_calls`, `tool_call_id`, `name` and `reasoning_content` for the template
(chat_messages.py).
Unknown fields are ignored, as SGLang does; those that would change the output and cannot be
honoured here (`response_format` other than text, `regex`, `json_schema`, `logit_bias`, ...:
admission.UNSERVED; `tool_choice` "required" or a named function) are refused.

What SGLang 0.5.23 adds to the answers is added the same way: `metadata` (the first answer's
`weight_version`, and its `weight_versions` spans) on non-streamed answers, and `sglext.routed_experts`
at the response level (not per choice), as `meta_info.routed_experts` encodes it on /generate.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from rollfleet.engine.http.chat_messages import check_tool_calls, template_message
from rollfleet.engine.http.chat_tools import check_tool_choice, check_tools, template_tool
from rollfleet.engine.runtime.admission import unserved
from rollfleet.wire.protocol import MAX_TOP_LOGPROBS, SEED_RANGE, GenerateRequest
from rollfleet.wire.request_fields import Lenient, Utf8Str


class StreamOptions(Lenient):
    include_usage: bool = False


class _Sampling(Lenient):
    """The fields both routes share, named as OpenAI (and SGLang's extras) name them."""

    model: Utf8Str = "default"
    n: int = Field(1, ge=1)
    stop: Utf8Str | list[Utf8Str] | None = None
    seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    user: str | None = None
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int = 0
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    no_stop_trim: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    lora_path: Utf8Str | None = None
    rid: Utf8Str | list[Utf8Str] | None = None
    return_text_in_logprobs: bool = False  # accepted: the OpenAI answers always carry token texts
    return_routed_experts: bool = False  # the engine needs --enable-return-routed-experts (/generate checks)
    routed_experts_start_len: int = 0

    @model_validator(mode="before")
    @classmethod
    def _nothing_unserved(cls, fields: Any) -> Any:
        if isinstance(fields, dict) and (why := unserved(fields)):
            raise ValueError(why)
        return fields

    def sampling_params(self, max_new_tokens: int | None) -> dict[str, Any]:
        """/generate's sampling_params; fields left unset keep /generate's defaults (checked there)."""
        params = {
            "max_new_tokens": max_new_tokens,
            "n": self.n,
            "stop": self.stop,
            "sampling_seed": self.seed,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "min_new_tokens": self.min_tokens,
            "stop_token_ids": self.stop_token_ids,
            "no_stop_trim": self.no_stop_trim,
            "ignore_eos": self.ignore_eos,
            "skip_special_tokens": self.skip_special_tokens,
            "frequency_penalty": self.frequency_penalty,
            "presence_penalty": self.presence_penalty,
            "repetition_penalty": self.repetition_penalty,
        }
        return {key: value for key, value in params.items() if value is not None}

    def routed_experts_fields(self) -> dict[str, Any]:
        return {
            "return_routed_experts": self.return_routed_experts,
            "routed_experts_start_len": self.routed_experts_start_len,
        }

    def sglext(self, metas: list[dict[str, Any]]) -> dict[str, Any] | None:
        """SGLang's response-level `sglext`: when asked, the `routed_experts` of the first answer that
        has them (base64 of int32 [tokens, layers, top_k], as on /generate; SGLang reports one set per
        response, also with n > 1); None when there is nothing to report."""
        if not self.return_routed_experts:
            return None
        routes = next((meta["routed_experts"] for meta in metas if meta.get("routed_experts")), None)
        return {"routed_experts": routes} if routes else None


class CompletionRequest(_Sampling):
    prompt: Utf8Str | list[Utf8Str] | list[int] | list[list[int]]
    max_tokens: int = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _some_prompt(cls, value):
        if value == []:  # SGLang: "Prompt cannot be empty"
            raise ValueError("prompt is an empty list: give a prompt (a string, token ids, or a list of either)")
        return value

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value: bool) -> bool:
        if value:
            raise ValueError("echo=true is not supported by the embedded engine: send echo=false")
        return value

    def generate_request(self) -> GenerateRequest:
        prompt = self.prompt
        by_ids = isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], str)
        return GenerateRequest(
            text=None if by_ids else prompt,
            input_ids=prompt if by_ids else None,
            sampling_params=self.sampling_params(self.max_tokens),
            return_logprob=self.logprobs is not None,
            top_logprobs_num=self.logprobs or 0,
            return_text_in_logprobs=True,
            rid=self.rid,
            lora_path=self.lora_path,
            **self.routed_experts_fields(),
        )


class ContentPart(Lenient):
    """One part of a message's content; parts other than text are refused when the prompt is made."""

    type: Utf8Str
    text: Utf8Str | None = None

    @model_validator(mode="after")
    def _text_has_text(self) -> ContentPart:
        if self.type == "text" and self.text is None:
            raise ValueError("a content part of type 'text' needs 'text' (a string)")
        return self


class ChatMessage(Lenient):
    """A chat message with what multi-turn tool conversations carry (chat_messages.py: as SGLang
    passes them to the chat template)."""

    role: Utf8Str
    content: Utf8Str | list[ContentPart] | None = None
    tool_calls: Any = None  # an assistant's calls, checked by the request (chat_messages.check_tool_calls)
    tool_call_id: Utf8Str | None = None  # a tool message: the call it answers
    name: Utf8Str | None = None
    reasoning_content: Utf8Str | None = None

    def as_template_input(self) -> dict[str, Any]:
        """The message as chat templates read it: text parts joined into one string (a tool
        message's with spaces, as SGLang's normalize_tool_content), content null as ""."""
        content = self.content
        if isinstance(content, list):
            kinds = sorted({part.type for part in content} - {"text"})
            if kinds:
                raise ValueError(f"message content parts of type {kinds}: this engine takes text parts only")
            content = (" " if self.role == "tool" else "").join(part.text for part in content)
        return template_message(self.role, content or "", self.model_dump(exclude={"role", "content"}))


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    chat_template_kwargs: dict[str, Any] | None = None
    separate_reasoning: bool = True  # accepted and ignored: no reasoning parser here
    continue_final_message: bool = False
    tools: list[Any] | None = None  # OpenAI function tools, rendered by the chat template (chat_tools.py)
    tool_choice: Any = None  # "auto" (the default with tools) or "none"; forcing a call is refused
    # SGLang's token ids on each choice (agent frameworks that keep a conversation's exact tokens):
    # prompt_token_ids with either, response_token_ids with return_token_ids; not on streams
    return_prompt_token_ids: bool = False
    return_token_ids: bool = False

    _tool_calls_are_served = field_validator("messages")(check_tool_calls)
    _tools_are_function_tools = field_validator("tools")(check_tools)
    _tool_choice_is_served = field_validator("tool_choice")(check_tool_choice)

    @field_validator("chat_template_kwargs")
    @classmethod
    def _no_tools_kwarg(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value and "tools" in value:  # SGLang passes both to the template: a TypeError there
            raise ValueError("chat_template_kwargs.tools: send the tools in the request's `tools` field")
        return value

    @model_validator(mode="after")
    def _token_ids_not_streamed(self) -> ChatCompletionRequest:
        if self.stream and (self.return_token_ids or self.return_prompt_token_ids):  # as SGLang 0.5.23
            raise ValueError(
                "return_token_ids and return_prompt_token_ids are not supported with streaming (set stream=false)"
            )
        return self

    def token_id_fields(self, prompt_ids: list[int], answer: dict) -> dict[str, Any]:
        """A choice's `prompt_token_ids` / `response_token_ids`, as asked."""
        fields: dict[str, Any] = {}
        if self.return_prompt_token_ids or self.return_token_ids:
            fields["prompt_token_ids"] = list(prompt_ids)
        if self.return_token_ids:
            fields["response_token_ids"] = list(answer["output_ids"])
        return fields

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools for the chat template, in SGLang's shape; None when there are none to render
        (no tools, or tool_choice "none")."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [template_tool(tool) for tool in self.tools]

    def generate_request(self, input_ids: list[int]) -> GenerateRequest:
        params = self.sampling_params(self.max_completion_tokens or self.max_tokens)
        if self.template_tools() is not None:  # SGLang keeps special tokens then: tool-call markers often are
            params["skip_special_tokens"] = False
        return GenerateRequest(
            input_ids=input_ids,
            sampling_params=params,
            return_logprob=self.logprobs,
            top_logprobs_num=(self.top_logprobs or 0) if self.logprobs else 0,
            return_text_in_logprobs=True,
            rid=self.rid,
            lora_path=self.lora_path,
            **self.routed_experts_fields(),
        )


def error_body(message: str, status_code: int = 400, param: str | None = None) -> dict[str, Any]:
    """OpenAI's (and SGLang's) error object."""
    kind = "BadRequestError" if status_code < 500 else "InternalServerError"
    return {"object": "error", "message": message, "type": kind, "param": param, "code": status_code}


def weight_version_metadata(meta: dict[str, Any]) -> dict[str, Any]:
    """SGLang's `metadata` of a non-streamed answer, from its first /generate answer: the weight
    version, and the spans (`weight_versions`) when the answer has them."""
    metadata = {"weight_version": meta["weight_version"]}
    if "weight_versions" in meta:
        metadata["weight_versions"] = meta["weight_versions"]
    return metadata


def finish_fields(meta: dict[str, Any]) -> dict[str, Any]:
    reason = meta.get("finish_reason")
    if reason is None:
        return {"finish_reason": None, "matched_stop": None}
    return {"finish_reason": reason["type"], "matched_stop": reason.get("matched")}


def usage(answers: list[dict[str, Any]], n: int) -> dict[str, int]:
    """Token counts: every answer's output, each prompt's input once (answers are grouped by prompt)."""
    prompt = sum(a["meta_info"]["prompt_tokens"] for i, a in enumerate(answers) if i % n == 0)
    completion = sum(a["meta_info"]["completion_tokens"] for a in answers)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def completion_logprobs(meta: dict[str, Any], start: int = 0) -> dict[str, Any]:
    """The legacy completions layout, from output token `start` on (a stream sends only new ones)."""
    triples = meta["output_token_logprobs"][start:]
    top = meta.get("output_top_logprobs")
    return {
        "tokens": [text for _, _, text in triples],
        "token_logprobs": [value for value, _, _ in triples],
        "top_logprobs": [] if top is None else [{t: v for v, _, t in row} for row in top[start:]],
        "text_offset": [-1] * len(triples),  # SGLang does not fill it either
    }


def chat_logprobs(meta: dict[str, Any], start: int = 0) -> dict[str, Any]:
    """The chat layout: one entry per output token from `start` on, with its top alternatives."""
    top = meta.get("output_top_logprobs") or []

    def entry(value, text):
        return {"token": text, "logprob": value, "bytes": list(text.encode("utf-8"))}

    content = []
    for index, (value, _, text) in enumerate(meta["output_token_logprobs"][start:], start):
        alternatives = top[index] if index < len(top) and top[index] else []
        content.append({**entry(value, text), "top_logprobs": [entry(v, t) for v, _, t in alternatives]})
    return {"content": content}


def envelope(kind: Literal["text_completion", "chat.completion", "chat.completion.chunk"], rid: str, model: str):
    return {"id": rid, "object": kind, "created": int(time.time()), "model": model}


class ModelCard(BaseModel):
    id: str
    object: str = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "sglang"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
