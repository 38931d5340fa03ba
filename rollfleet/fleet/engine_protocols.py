"""The protocol each engine speaks, read once when the engine becomes reachable (first start and
every restart): its `/get_server_info`, through the pool's client, which keeps the answer for the
weight senders (EngineClient.server_protocol). An SGLang release whose weight-update protocol the
senders were not proven against stops the start here, rather than at the first weight push after a
round of rollouts; the embedded engine always passes."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from rollfleet.wire.client import UnsupportedEngine
from rollfleet.wire.pool import EnginePool


def check_engine_protocols(
    pool: EnginePool,
    engine_ids: Iterable[int],
    *,
    on_refusal: Callable[[], None] | None = None,
    timeout_s: float | None = None,
) -> None:
    """Read every engine's `/get_server_info` (concurrently; cached per engine client), each within
    `timeout_s` (None: the client's own timeout). Raises UnsupportedEngine naming the engine, its
    release, the supported range and the fix, after `on_refusal()` (on any failure: a starting fleet
    shuts itself down: no engine outlives a refused start)."""
    pending = {e: pool.submit(pool.client(e).server_protocol(timeout_s)) for e in engine_ids}
    try:
        for engine_id, answer in pending.items():
            try:
                answer.result()
            except UnsupportedEngine as exc:
                where = "rollout.sglang_command names the program that starts it"
                raise UnsupportedEngine(f"engine {engine_id}: {exc} ({where})") from None
    except BaseException:
        if on_refusal is not None:
            on_refusal()
        raise
