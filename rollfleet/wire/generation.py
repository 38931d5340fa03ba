"""EngineClient's generation routes: /generate with every field SGLang's clients send, and its
server-sent-event stream. Kept apart from client.py, which holds the control routes."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson

from rollfleet.wire.errors import EngineError, EngineTimeout, message_of


def generate_payload(**fields: Any) -> dict:
    """A /generate body: the fields given, without those left None (the server's defaults apply)."""
    return {name: value for name, value in fields.items() if value is not None}


class GenerationRoutes:
    """Mixed into EngineClient, which provides `_call`, `_http`, `base_url` and the errors."""

    async def generate(
        self,
        *,
        text: str | list[str] | None = None,
        input_ids: list | None = None,
        sampling_params: dict | list[dict] | None = None,
        return_logprob: bool = False,
        logprob_start_len: int | None = None,
        top_logprobs_num: int | None = None,
        token_ids_logprob: list[int] | None = None,
        return_text_in_logprobs: bool | None = None,
        return_routed_experts: bool | None = None,
        routed_experts_start_len: int | None = None,
        rid: str | list[str] | None = None,
        lora_path: str | list[str | None] | None = None,
        timeout: float | None = None,
    ) -> dict | list[dict]:
        """SGLang's /generate; a field left None is not sent (the server's default applies).
        `logprob_start_len` >= 0 adds `input_token_logprobs` from that prompt position;
        `top_logprobs_num` / `token_ids_logprob` add `*_top_logprobs` / `*_token_ids_logprob`;
        `return_routed_experts` asks a MoE engine for `meta_info.routed_experts`;
        `sampling_params` carries SGLang's sampling fields as they are (`no_stop_trim`, `stop`, `n`, ...)."""
        payload = generate_payload(
            text=text,
            input_ids=input_ids,
            sampling_params=sampling_params or {},
            return_logprob=return_logprob,
            logprob_start_len=logprob_start_len,
            top_logprobs_num=top_logprobs_num,
            token_ids_logprob=token_ids_logprob,
            return_text_in_logprobs=return_text_in_logprobs,
            return_routed_experts=return_routed_experts,
            routed_experts_start_len=routed_experts_start_len,
            rid=rid,
            lora_path=lora_path,
        )
        return await self._call("POST", "/generate", payload, timeout=timeout)

    async def generate_stream(self, *, timeout: float | None = None, **fields: Any) -> AsyncIterator[dict]:
        """/generate with `stream: true`: each server-sent event's answer as it comes (SGLang's are
        cumulative: `text` and `output_ids` so far; a batch's events carry `index`), until `[DONE]`.
        `fields` are `generate`'s. A refusal raises EngineError before the first event."""
        payload = {**generate_payload(**{"sampling_params": {}, **fields}), "stream": True}
        try:
            async with self._http.stream(
                "POST", "/generate", json=payload, timeout=timeout, headers=self.auth_headers("/generate")
            ) as response:
                if response.status_code >= 400:
                    await response.aread()
                    raise EngineError("/generate", response.status_code, message_of(response))
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue  # the blank line between events
                    data = line[len("data:") :].strip()
                    if data == "[DONE]":
                        return
                    yield json_value(data)  # cumulative: each event carries every token so far
        except httpx.TimeoutException as exc:
            raise EngineTimeout("/generate", 0, f"no answer from {self.base_url} in time ({exc!r})") from exc


def json_value(data: bytes | str) -> Any:
    """An answer's or an event's JSON, read by orjson (half json's time for 512 answers of 256
    logprobs), or by Python's parser where only it reads it (a non-standard NaN); ValueError when
    neither can."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return json.loads(data)
