"""The engine pool (one client per engine on one loop thread) against a real engine server, and the
decision whether a sender opens weight-update sessions (the SGLang-version-aware recipe)."""

from __future__ import annotations

import pytest

from rollfleet.config import TensorSync
from rollfleet.weights.transports import EngineTarget, make_transport
from rollfleet.wire.client import EngineError, EngineUnreachable, uses_weight_update_sessions
from rollfleet.wire.net import free_port
from rollfleet.wire.pool import EnginePool


@pytest.mark.parametrize(
    "info, uses",
    [
        ({"version": "0.5.21"}, True),  # SGLang refuses tensor/distributed updates outside a session from here on
        ({"version": "0.5.23.post1"}, True),
        ({"version": "0.6.0rc1"}, True),
        ({"version": "0.5.20"}, False),  # no session routes yet
        ({"version": "0.4.10.post2"}, False),
        ({"version": "main"}, False),
        ({}, False),
        ({"engine": "rollfleet-embedded", "version": "0.1.0", "rollfleet_weight_update_sessions": True}, True),
        ({"engine": "rollfleet-embedded", "version": "9.9.9"}, False),  # its version is rollfleet's, not SGLang's
        ({"version": "0.5.22", "rollfleet_weight_update_sessions": False}, False),  # the engine's word wins
    ],
)
def test_weight_update_sessions_where_the_engine_has_them(info, uses):
    assert uses_weight_update_sessions(info) is uses


@pytest.fixture(scope="module")
def server(qwen3_server):
    """conftest's plain qwen3 server, shared with the other engine modules (reset for each)."""
    return qwen3_server


def test_one_client_per_engine_calls_each_and_replaced_urls(server):
    pool = EnginePool.for_urls({0: server.url, 1: server.url}, timeout=30)
    try:
        client = pool.client(0)
        assert pool.call(0, "get_model_info")["weight_version"] == "default"
        assert uses_weight_update_sessions(pool.call(0, "get_server_info"))  # the embedded engine has sessions
        answers = pool.each("health", {0: ((), {}), 1: ((2.0,), {})}).result()
        assert answers == [True, True]
        pool.set_url(0, server.url + "/")  # the same place: the same client
        assert pool.client(0) is client
        pool.set_url(1, f"http://127.0.0.1:{free_port()}")  # a restart on another port: a new client
        assert pool.on_all("health", [1], 1.0) == [False]  # nothing answers there: a failed probe, no error
        with pytest.raises(EngineUnreachable):  # the first error fails the future after every call ended
            pool.each("get_model_info", {0: ((), {}), 1: ((), {})}).result()
        with pytest.raises(EngineError, match="top_k"):
            pool.call(0, "generate", input_ids=[1, 2], sampling_params={"top_k": 0})
        with pytest.raises(KeyError, match="engine_id=7"):
            pool.client(7)

        async def nested():
            return pool.run(pool.client(0).get_model_info())  # would wait on its own loop forever

        with pytest.raises(RuntimeError, match="own loop"):
            pool.run(nested())
    finally:
        pool.close()


def test_a_begin_that_fails_on_one_engine_closes_the_sessions_it_opened(server):
    """A push retried after an engine died must not find the survivor's session still open."""
    dead = f"http://127.0.0.1:{free_port()}"
    targets = [EngineTarget(0, server.url, 1, 1), EngineTarget(1, dead, 1, 2)]
    transport = make_transport(TensorSync(), targets, timeout_s=10)
    try:
        transport.session_engines = {0, 1}  # as if both had answered /get_server_info
        with pytest.raises(EngineUnreachable):
            transport._begin()
        transport.pool.call(0, "begin_weight_update")  # refused if the failed begin had left one open
        with pytest.raises(EngineError, match="did not arrive"):
            transport.pool.call(0, "end_weight_update")  # nothing sent: refused, nothing changed
        assert transport.pool.call(0, "get_model_info")["weight_version"] == "default"
    finally:
        transport.disconnect()
