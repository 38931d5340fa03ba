"""EngineClient's weight routes: updates from disk, from tensors and over a broadcast group (its join
and end), weight-update sessions, the version, weight reads and fingerprints, and R-Fork's transfer of
every weight from a running engine. Kept apart from client.py, which holds the connection and the other
control routes (status, LoRA, memory, pausing)."""

from __future__ import annotations

from rollfleet.wire.remote_instance import INIT_ROUTE, LAYOUT_ROUTE, LOAD_ROUTE, SEND_ROUTE, format_ports


class WeightRoutes:
    """Mixed into EngineClient, which provides `_call` and `timeout`."""

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
            timeout=max(self.timeout, timeout_s + 30),
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
        return await self._call("POST", LOAD_ROUTE, payload, timeout=max(self.timeout, 2 * timeout_s + 60))

    async def weight_layout(self) -> dict:
        """rollfleet extension (embedded engine): tp/ep size, dtype, version and [name, shape, dtype] per parameter."""
        return await self._call("GET", LAYOUT_ROUTE)
