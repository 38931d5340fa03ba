"""EngineClient's generation routes: /generate with every field SGLang's clients send, and its
server-sent-event stream. Kept apart from client.py, which holds the control routes."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson

from rollfleet.wire.errors import EngineError, EngineTimeout, EngineUnreachable, message_of


def generate_payload(**fields: Any) -> dict:
    """A /generate body: the fields given, without those left None (the server's defaults apply)."""
    return {name: value for name, value in fields.items() if value is not None}


class GenerationRoutes:
    """Mixed into EngineClient, which provides `_call`, `_session`, `_timeouts`, `auth_headers` and `base_url`."""

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
        return_logprob_values: bool | None = None,
        timeout: float | None = None,
    ) -> dict | list[dict]:
        """SGLang's /generate; a field left None is not sent (the server's default applies).
        `logprob_start_len` >= 0 adds `input_token_logprobs` from that prompt position;
        `top_logprobs_num` / `token_ids_logprob` add `*_top_logprobs` / `*_token_ids_logprob`;
        `return_routed_experts` asks a MoE engine for `meta_info.routed_experts`; `return_logprob_values`
        (the embedded engine's, never for SGLang) answers `output_token_logprob_values` instead of the triples;
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
            return_logprob_values=return_logprob_values,
        )
        return await self._call("POST", "/generate", payload, timeout=timeout)

    async def generate_stream(self, *, timeout: float | None = None, **fields: Any) -> AsyncIterator[dict]:
        """/generate with `stream: true`: each server-sent event's answer as it comes (SGLang's are
        cumulative: `text` and `output_ids` so far; a batch's events carry `index`), until `[DONE]`.
        `fields` are `generate`'s. A refusal raises EngineError before the first event."""
        payload = {**generate_payload(**{"sampling_params": {}, **fields}), "stream": True}
        headers = {**self.auth_headers("/generate"), "Content-Type": "application/json"}
        try:
            async with self._session().post(
                self.base_url + "/generate", data=json_body(payload), headers=headers, timeout=self._timeouts(timeout)
            ) as response:
                if response.status >= 400:
                    raise EngineError("/generate", response.status, message_of(await response.read()))
                async for line in _lines(response.content):
                    if not line.startswith(b"data:"):
                        continue  # the blank line between events
                    data = line[len(b"data:") :].strip()
                    if data == b"[DONE]":
                        return
                    yield json_value(data)  # cumulative: each event carries every token so far
        except TimeoutError as exc:
            raise EngineTimeout("/generate", 0, f"no answer from {self.base_url} in time ({exc!r})") from exc
        except aiohttp.ClientError as exc:
            raise EngineUnreachable("/generate", self.base_url, exc) from exc


async def _lines(stream: aiohttp.StreamReader) -> AsyncIterator[bytes]:
    """The lines of a server-sent-event stream, however long (aiohttp's own line reader stops at 64 KiB,
    and an event of a long answer with logprobs is larger)."""
    pending = bytearray()
    async for chunk in stream.iter_any():
        pending += chunk
        while (end := pending.find(b"\n")) >= 0:
            yield bytes(pending[:end]).rstrip(b"\r")
            del pending[: end + 1]
    if pending:
        yield bytes(pending)


def json_body(payload: Any) -> bytes:
    """A request body as JSON: orjson, or Python's encoder for what orjson refuses (an integer past
    64 bits, a non-string key)."""
    try:
        return orjson.dumps(payload)
    except TypeError:  # orjson.JSONEncodeError is a TypeError
        return json.dumps(payload).encode()


def json_value(data: bytes | str) -> Any:
    """An answer's or an event's JSON, read by orjson (half json's time for 512 answers of 256
    logprobs), or by Python's parser where only it reads it (a non-standard NaN); ValueError when
    neither can."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return json.loads(data)
