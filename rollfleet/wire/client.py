"""Async HTTP client for one engine: the embedded server or a real SGLang server (same protocol).

Every method maps to one route, and carries the key that route takes (rollfleet.wire.auth: the admin key
on admin routes, the API key on the others). A non-2xx answer raises `EngineError` carrying the status and
the server's own message; a slow answer raises `EngineTimeout` after `timeout` seconds.
"""

from __future__ import annotations

from typing import Any

import httpx

from rollfleet.wire.auth import key_for
from rollfleet.wire.errors import EngineError, EngineTimeout, message_of
from rollfleet.wire.generation import GenerationRoutes
from rollfleet.wire.protocol_versions import (  # noqa: F401  (EngineClient's callers import them here)
    SESSIONS_SINCE_SGLANG,
    SUPPORTED_SGLANG,
    UnsupportedEngine,
    check_supported,
    is_embedded,
    sglang_release,
    uses_weight_update_sessions,
)
from rollfleet.wire.remote_instance import INIT_ROUTE, LAYOUT_ROUTE, LOAD_ROUTE, SEND_ROUTE, format_ports

__all__ = ["EngineClient", "EngineError", "EngineTimeout", "uses_weight_update_sessions"]
PAUSE_MODES = ("abort", "retract", "in_place")


class EngineClient(GenerationRoutes):
    def __init__(
        self, base_url: str, *, api_key: str | None = None, admin_api_key: str | None = None, timeout: float = 300.0
    ):
        self.base_url = base_url.rstrip("/")
        self._server_info: dict | None = None  # server_protocol's answer, once read
        self._keys = (api_key, admin_api_key)
        # An https engine gets httpx's default certificate checks; plain http needs no TLS context,
        # and building one (loading the CA bundle) costs 15-30 ms per client.
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            timeout=timeout,
            verify=self.base_url.startswith("https://"),
            # idle connections dropped well before the server's keep-alive (uvicorn's and SGLang's: 5 s)
            # closes them: at equal timeouts a request sent on a connection the server is closing
            # fails with ReadError (an agent run, 128 turns at once, lost every one at step 26)
            limits=httpx.Limits(max_connections=512, max_keepalive_connections=64, keepalive_expiry=2.0),
        )

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        await self._http.aclose()

    async def _call(self, method: str, route: str, payload: dict | None = None, *, timeout: float | None = None) -> Any:
        kwargs: dict[str, Any] = {} if payload is None else {"json": payload}
        kwargs["headers"] = self.auth_headers(route)
        if timeout is not None:
            kwargs["timeout"] = timeout
        try:
            response = await self._http.request(method, route, **kwargs)
        except httpx.TimeoutException as exc:
            raise EngineTimeout(route, 0, f"no answer from {self.base_url} in time ({exc!r})") from exc
        if response.status_code >= 400:
            raise EngineError(route, response.status_code, message_of(response))
        if not response.content:
            return None
        try:
            return response.json()
        except ValueError:
            return response.text

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
        except (EngineError, httpx.TransportError):
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

    # ---- weights -----------------------------------------------------------------------------------
    async def update_weights_from_disk(
        self,
        model_path: str,
        *,
        weight_version: str | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
    ) -> dict:
        payload = {"model_path": model_path, "flush_cache": flush_cache, "abort_all_requests": abort_all_requests}
        if weight_version is not None:
            payload["weight_version"] = weight_version
        return await self._call("POST", "/update_weights_from_disk", payload)

    async def update_weights_from_tensor(
        self,
        serialized_named_tensors: list[str],
        *,
        load_format: str | None = None,
        weight_version: str | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
    ) -> dict:
        """One payload per tp rank, each from its own `rollfleet.wire.serialize.serialize` call (never
        the same string for several ranks); load_format None, "direct" or "flattened_bucket". The sender
        keeps its tensors alive until this returns."""
        payload = {
            "serialized_named_tensors": serialized_named_tensors,
            "load_format": load_format,
            "flush_cache": flush_cache,
            "abort_all_requests": abort_all_requests,
        }
        if weight_version is not None:
            payload["weight_version"] = weight_version
        return await self._call("POST", "/update_weights_from_tensor", payload)

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        *,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
        timeout_s: float | None = None,
    ) -> dict:
        """Blocks until every engine rank joined; group rank 0 (the caller's sender) must join meanwhile.
        `timeout_s` is a rollfleet extension (the embedded engine's default is 60 s); SGLang ignores it."""
        payload = {
            "master_address": master_address,
            "master_port": master_port,
            "rank_offset": rank_offset,
            "world_size": world_size,
            "group_name": group_name,
            "backend": backend,
        }
        if timeout_s is None:
            return await self._call("POST", "/init_weights_update_group", payload)
        return await self._call(
            "POST",
            "/init_weights_update_group",
            {**payload, "timeout_s": timeout_s},
            timeout=max(self._http.timeout.read or 0, timeout_s + 30),
        )

    async def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        *,
        group_name: str = "weight_update_group",
        load_format: str | None = None,
        weight_version: str | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
        order: tuple[str, int] | None = None,
    ) -> dict:
        """Announce the broadcasts the sender makes now (dtypes by name: "bfloat16"; see
        rollfleet.wire.buckets.dtype_name). load_format None: one broadcast per tensor;
        "flattened_bucket": one uint8 broadcast of all their bytes, in order. `order`: (sync id,
        call number) for engines with `rollfleet_ordered_weight_calls` (rollfleet.engine.weights.call_order)."""
        payload = {
            "names": names,
            "dtypes": dtypes,
            "shapes": [list(s) for s in shapes],
            "group_name": group_name,
            "load_format": load_format,
            "flush_cache": flush_cache,
            "abort_all_requests": abort_all_requests,
        }
        if weight_version is not None:
            payload["weight_version"] = weight_version
        if order is not None:
            payload["rollfleet_sync_id"], payload["rollfleet_call"] = order
        return await self._call("POST", "/update_weights_from_distributed", payload)

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> dict:
        return await self._call("POST", "/destroy_weights_update_group", {"group_name": group_name})

    async def begin_weight_update(self, selector: str = "all") -> dict:
        """Open a weight-update session (SGLang >= 0.5.21; see `uses_weight_update_sessions`): inside it,
        a call's weight_version is applied only when `end_weight_update` succeeds."""
        return await self._call("POST", "/begin_weight_update", {"selector": selector})

    async def end_weight_update(self) -> dict:
        """Close the session: the engine commits the update (a 400 when it is incomplete)."""
        return await self._call("POST", "/end_weight_update", {})

    async def update_weight_version(self, new_version: str, *, abort_all_requests: bool = False) -> dict:
        return await self._call(
            "POST", "/update_weight_version", {"new_version": new_version, "abort_all_requests": abort_all_requests}
        )

    async def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list[float]:
        return await self._call("POST", "/get_weights_by_name", {"name": name, "truncate_size": truncate_size})

    async def weights_fingerprint(
        self, names: list[str] | None = None, samples: int = 4096, *, lora_name: str | None = None
    ) -> dict[str, str]:
        """rollfleet extension (embedded engine): checkpoint name -> rollfleet.wire.fingerprint; with
        `lora_name`, peft key -> fingerprint of that loaded adapter's tensors."""
        payload = {"names": names, "samples": samples}
        if lora_name is not None:
            payload["lora_name"] = lora_name
        return await self._call("POST", "/rollfleet/weights_fingerprint", payload)

    # ---- R-Fork: load weights from a running engine (rollfleet.wire.remote_instance) ------------------
    async def init_weights_send_group_for_remote_instance(
        self,
        master_address: str,
        ports: list[int] | str,
        *,
        group_rank: int = 0,
        world_size: int = 2,
        group_name: str = "weight_send_group",
        backend: str = "nccl",
    ) -> dict:
        """To the seed: its tp rank i serves a group of two at master_address:ports[i] (blocks until the
        destination's rank i joined it)."""
        payload = {
            "master_address": master_address,
            "ports": format_ports(ports),
            "group_rank": group_rank,
            "world_size": world_size,
            "group_name": group_name,
            "backend": backend,
        }
        return await self._call("POST", INIT_ROUTE, payload)

    async def send_weights_to_remote_instance(
        self, master_address: str, ports: list[int] | str, *, group_name: str = "weight_send_group"
    ) -> dict:
        """To the seed: broadcast every parameter on the joined groups (answers when all were sent)."""
        payload = {"master_address": master_address, "ports": format_ports(ports), "group_name": group_name}
        return await self._call("POST", SEND_ROUTE, payload)

    async def load_from_remote_instance(
        self,
        seed_host: str,
        seed_port: int,
        ports: list[int] | str,
        *,
        group_name: str | None = None,
        backend: str | None = None,
        timeout_s: float = 300.0,
    ) -> dict:
        """rollfleet extension (embedded engine): pull every weight from the seed at seed_host:seed_port;
        `ports` are free on the seed's host. Answers `{success, message, weight_version}`."""
        payload = {
            "seed_host": seed_host,
            "seed_port": seed_port,
            "ports": format_ports(ports),
            "group_name": group_name,
            "backend": backend,
            "timeout_s": timeout_s,
        }
        return await self._call(
            "POST", LOAD_ROUTE, payload, timeout=max(self._http.timeout.read or 0, 2 * timeout_s + 60)
        )

    async def weight_layout(self) -> dict:
        """rollfleet extension (embedded engine): tp/ep size, dtype, version and [name, shape, dtype] per parameter."""
        return await self._call("GET", LAYOUT_ROUTE)

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
    ) -> dict:
        """One payload per tp rank (its own `rollfleet.wire.serialize.serialize` call) of (peft key,
        tensor) pairs, or flattened buckets with load_format="flattened_bucket"; `config_dict` is the
        peft config as adapter_config.json holds it. The sender keeps its tensors alive until this returns."""
        return await self._call(
            "POST",
            "/load_lora_adapter_from_tensors",
            {
                "lora_name": lora_name,
                "config_dict": config_dict,
                "serialized_named_tensors": serialized_named_tensors,
                "load_format": load_format,
                "pinned": pinned,
            },
        )

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
