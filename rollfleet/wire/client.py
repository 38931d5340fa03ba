"""Async HTTP client for one engine: the embedded server or a real SGLang server (same protocol).

Every method maps to one route, and carries the key that route takes (rollfleet.wire.auth: the admin key
on admin routes, the API key on the others). A non-2xx answer raises `EngineError` carrying the status and
the server's own message; a slow answer raises `EngineTimeout` after `timeout` seconds; a connection
refused, reset or closed under a request raises `EngineUnreachable`.
The generate routes are generation.py's, the weight routes weight_routes.py's (both mixed in).

The transport is aiohttp, not httpx: a GRPO step sends a request per prompt at once (an agent run one
per episode's turn), and httpx's connection pool walks every connection for every request queued or
finished. Measured on this project's 2-core CPU, 64 concurrent POSTs to a server that answers at once:
httpx 250 ms of the client's CPU a wave (16 httpx clients side by side: 65 ms), aiohttp 9-13 ms;
256 at once: 0.6-1.3 s against 39 ms. The client's CPU is time the requests arrive late.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp

from rollfleet.wire.auth import key_for
from rollfleet.wire.errors import EngineError, EngineTimeout, EngineUnreachable, message_of
from rollfleet.wire.generation import GenerationRoutes, json_body, json_value
from rollfleet.wire.protocol_versions import (  # noqa: F401  (EngineClient's callers import them here)
    SESSIONS_SINCE_SGLANG,
    SUPPORTED_SGLANG,
    UnsupportedEngine,
    check_supported,
    is_embedded,
    sglang_release,
    uses_weight_update_sessions,
)
from rollfleet.wire.weight_routes import WeightRoutes

__all__ = ["EngineClient", "EngineError", "EngineTimeout", "EngineUnreachable", "uses_weight_update_sessions"]
PAUSE_MODES = ("abort", "retract", "in_place")
JSON_HEADERS = {"Content-Type": "application/json"}


def parse_answer(content: bytes) -> Any:
    """An answer's JSON (`json_value`), or its text when it is not JSON; None when it is empty."""
    if not content:
        return None
    try:
        return json_value(content)
    except ValueError:
        return content.decode("utf-8", "replace")


class EngineClient(GenerationRoutes, WeightRoutes):
    def __init__(
        self, base_url: str, *, api_key: str | None = None, admin_api_key: str | None = None, timeout: float = 300.0
    ):
        """`timeout`: seconds to connect, and between two reads of an answer (an answer's whole time
        may be longer while bytes keep coming, as a stream's do)."""
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self._server_info: dict | None = None  # server_protocol's answer, once read
        self._keys = (api_key, admin_api_key)
        self._http: aiohttp.ClientSession | None = None  # made on first use, on the loop that uses it
        self._http_loop: asyncio.AbstractEventLoop | None = None

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        if self._http is not None and self._http_loop is asyncio.get_running_loop():
            await self._http.close()
        self._http = self._http_loop = None

    def _session(self) -> aiohttp.ClientSession:
        """The connection pool of the running event loop (a client made outside any loop, as the
        engine pool's are, gets its pool on the loop of its first call)."""
        loop = asyncio.get_running_loop()
        if self._http is None or self._http_loop is not loop or self._http.closed:
            # idle connections dropped well before the server's keep-alive (uvicorn's and SGLang's: 5 s)
            # closes them: at equal timeouts a request sent on a connection the server is closing
            # fails (an agent run, 128 turns at once, lost every one at step 26). An https engine gets
            # the default certificate checks; plain http needs no TLS context.
            connector = aiohttp.TCPConnector(
                limit=512, keepalive_timeout=2.0, ssl=None if self.base_url.startswith("https://") else False
            )
            self._http, self._http_loop = aiohttp.ClientSession(connector=connector), loop
        return self._http

    def _timeouts(self, timeout: float | None) -> aiohttp.ClientTimeout:
        seconds = self.timeout if timeout is None else timeout
        return aiohttp.ClientTimeout(total=None, sock_connect=seconds, sock_read=seconds)

    async def _call(self, method: str, route: str, payload: dict | None = None, *, timeout: float | None = None) -> Any:
        headers = self.auth_headers(route)
        body = None if payload is None else json_body(payload)
        if body is not None:
            headers.update(JSON_HEADERS)
        try:
            async with self._session().request(
                method, self.base_url + route, data=body, headers=headers, timeout=self._timeouts(timeout)
            ) as response:
                status, content = response.status, await response.read()
        except TimeoutError as exc:  # aiohttp's read and connect timeouts are TimeoutErrors
            raise EngineTimeout(route, 0, f"no answer from {self.base_url} in time ({exc!r})") from exc
        except aiohttp.ClientError as exc:
            raise EngineUnreachable(route, self.base_url, exc) from exc
        if status >= 400:
            raise EngineError(route, status, message_of(content))
        return parse_answer(content)

    def auth_headers(self, route: str) -> dict[str, str]:
        key = key_for(route, *self._keys)
        return {"Authorization": f"Bearer {key}"} if key else {}

    # ---- status (generation: rollfleet.wire.generation) ----------------------------------------
    async def health(self, timeout: float = 5) -> bool:
        """Whether /health answers 200 within `timeout` seconds (the fleet's probes of hung engines)."""
        return await self._answers("/health", timeout)

    async def health_generate(self, timeout: float = 30) -> bool:
        """Whether /health_generate answers 200 (the engine serves: weights loaded, loop alive)."""
        return await self._answers("/health_generate", timeout)

    async def _answers(self, route: str, timeout: float) -> bool:
        try:
            await self._call("GET", route, timeout=timeout)
            return True
        except (EngineError, EngineUnreachable):
            return False

    async def get_model_info(self) -> dict:
        return await self._call("GET", "/get_model_info")

    async def get_server_info(self, timeout: float | None = None) -> dict:
        return await self._call("GET", "/get_server_info", timeout=timeout)

    async def server_protocol(self, timeout: float | None = None) -> dict:
        """`/get_server_info`, read once per client (the engine's kind and release do not change while
        it runs), after `check_supported`: raises UnsupportedEngine for an SGLang release outside
        SUPPORTED_SGLANG. `timeout`: seconds for the read (None: the client's)."""
        if self._server_info is None:
            info = await self.get_server_info(timeout)
            check_supported(info, self.base_url)
            self._server_info = info
        return self._server_info

    async def flush_cache(self) -> str:
        return await self._call("POST", "/flush_cache")

    # ---- LoRA adapters (answers: {success, error_message, loaded_adapters: {name: path}}) -------------
    async def load_lora_adapter(self, lora_name: str, lora_path: str, *, pinned: bool = False) -> dict:
        """Load a peft adapter directory (adapter_config.json + adapter_model.safetensors) under `lora_name`."""
        return await self._call(
            "POST", "/load_lora_adapter", {"lora_name": lora_name, "lora_path": lora_path, "pinned": pinned}
        )

    async def load_lora_adapter_from_tensors(
        self,
        lora_name: str,
        config_dict: dict,
        serialized_named_tensors: list[str],
        *,
        load_format: str | None = None,
        pinned: bool = False,
        weight_version: str | None = None,
        unload_lora_names: list[str] | None = None,
    ) -> dict:
        """One payload per tp rank (its own `rollfleet.wire.serialize.serialize` call) of (peft key,
        tensor) pairs, or flattened buckets with load_format="flattened_bucket"; `config_dict` is the
        peft config as adapter_config.json holds it. The sender keeps its tensors alive until this returns.
        `weight_version`, `unload_lora_names`: set and unloaded once it loaded, in the same call (the
        embedded engine's extension, `rollfleet_lora_load_then_version`; never sent to SGLang)."""
        body = {
            "lora_name": lora_name,
            "config_dict": config_dict,
            "serialized_named_tensors": serialized_named_tensors,
            "load_format": load_format,
            "pinned": pinned,
        }
        if weight_version is not None:
            body["rollfleet_weight_version"] = weight_version
        if unload_lora_names is not None:
            body["rollfleet_unload_lora_names"] = unload_lora_names
        return await self._call("POST", "/load_lora_adapter_from_tensors", body)

    async def unload_lora_adapter(self, lora_name: str) -> dict:
        return await self._call("POST", "/unload_lora_adapter", {"lora_name": lora_name})

    async def list_models(self) -> dict:
        """`/v1/models`: the served model's card, then one card per loaded LoRA adapter (`parent`: the model)."""
        return await self._call("GET", "/v1/models")

    async def loaded_lora_adapters(self) -> dict[str, str]:
        """Adapter name -> the path it was loaded from, read where SGLang lists adapters: the `/v1/models`
        cards that have a `parent` (SGLang's /get_model_info has no adapter list)."""
        cards = (await self.list_models())["data"]
        return {card["id"]: card["root"] for card in cards if card.get("parent") is not None}

    async def memory(self) -> list[dict[str, int]]:
        """rollfleet extension (embedded engine): memory figures per tp rank."""
        return await self._call("GET", "/rollfleet/memory")

    async def shard_fingerprints(self) -> list[dict[str, str]]:
        """rollfleet extension (embedded engine only): sha256 per parameter per tp rank."""
        return await self._call("GET", "/rollfleet/shard_fingerprints")

    # ---- memory, abort, pause --------------------------------------------------------------------
    async def release_memory_occupation(self, tags: list[str] | None = None) -> dict:
        return await self._call("POST", "/release_memory_occupation", {"tags": tags})

    async def resume_memory_occupation(self, tags: list[str] | None = None) -> dict:
        return await self._call("POST", "/resume_memory_occupation", {"tags": tags})

    async def abort_request(self, rid: str = "", *, abort_all: bool = False) -> dict:
        return await self._call("POST", "/abort_request", {"rid": rid, "abort_all": abort_all})

    async def pause_generation(self, mode: str = "abort") -> dict:
        """Stop generating (SGLang's modes): "abort" ends every unfinished request; "in_place" keeps
        the running requests; "retract" queues them again without their KV cache. Weight updates
        apply while paused; `continue_generation` goes on, on the new weights (each answer's
        `meta_info.weight_versions` then says which tokens each version made)."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause_generation mode={mode!r}: use one of {', '.join(PAUSE_MODES)}")
        return await self._call("POST", "/pause_generation", {"mode": mode})

    async def continue_generation(self) -> dict:
        return await self._call("POST", "/continue_generation", {})

    async def step(self, steps: int = 1) -> dict:
        """rollfleet extension (embedded engine only): a paused engine runs `steps` more steps, then
        holds; the answer says how many ran (`steps_run`) and the scheduler's stats after them."""
        return await self._call("POST", "/rollfleet/step", {"steps": steps})
