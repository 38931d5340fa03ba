"""An arrival wave starts as one batch (rollfleet/engine/runtime/arrivals.py): an idle engine does not
start a batch while a generation request is still being read, up to --rollfleet-arrival-wait-ms; a
request that never finishes arriving holds nobody back for longer than that.

A request "still being read" is made exact here: a raw socket sends a /generate's headers and half
its body, and the rest only when the test says so."""

from __future__ import annotations

import json
import socket
import threading
from concurrent.futures import Future

import httpx
import pytest
from conftest import call, engine_server
from waits import wait_until

from rollfleet.engine.runtime.arrivals import Arrivals

SHORT = {"max_new_tokens": 2, "ignore_eos": True, "temperature": 0}


# ---- the rule ------------------------------------------------------------------------------------
def test_an_idle_engine_holds_back_only_while_a_request_is_being_read():
    arrivals = Arrivals(threading.Condition(), wait_s=3600)  # a wait no test outlasts
    assert not arrivals.hold_back()  # nobody arriving
    first, second = arrivals.begin(), arrivals.begin()
    assert arrivals.hold_back() and arrivals.holds == 1
    first.queued()
    first.queued()  # once only: a request marked queued and then ended counts down once
    assert arrivals.reading == 1 and arrivals.hold_back() and arrivals.holds == 1  # the same wait
    second.queued()
    assert not arrivals.hold_back() and arrivals.reading == 0
    arrivals.begin()
    assert arrivals.hold_back() and arrivals.holds == 2  # a new wave, a new wait
    assert 0 < arrivals.wait_timeout(0.5) <= 0.5  # the engine thread sleeps until the wait ends at most


def test_a_wait_of_zero_never_holds_back():
    arrivals = Arrivals(threading.Condition(), wait_s=0)
    arrivals.begin()
    assert not arrivals.hold_back() and arrivals.holds == 0


# ---- on a server ---------------------------------------------------------------------------------
class HalfSent:
    """A /generate whose body is sent in two halves: the server reads it until `finish()`."""

    def __init__(self, server, body: dict):
        raw = json.dumps(body).encode()
        self.rest = raw[len(raw) // 2 :]
        head = (
            f"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(raw)}\r\nConnection: close\r\n\r\n"
        ).encode()
        self.sock = socket.create_connection(("127.0.0.1", server.port), timeout=120)
        self.sock.sendall(head + raw[: len(raw) // 2])

    def finish(self) -> dict:
        self.sock.sendall(self.rest)
        answer = b""
        while chunk := self.sock.recv(65536):
            answer += chunk
        self.sock.close()
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), answer[:500]
        return json.loads(body)

    def close(self) -> None:
        self.sock.close()


def stats(server) -> dict:
    return call(server, "get_server_info")["scheduler_stats"]


def generate_in_background(server, body: dict) -> Future:
    done: Future = Future()

    def go():
        try:
            done.set_result(httpx.post(server.url + "/generate", json=body, timeout=120).json())
        except Exception as exc:  # noqa: BLE001 - reported through the future
            done.set_exception(exc)

    threading.Thread(target=go, daemon=True).start()
    return done


@pytest.fixture(scope="module")
def patient_server(qwen3_dir, tmp_path_factory):
    """A server whose idle engine waits for arrivals as long as any test runs."""
    with engine_server(
        qwen3_dir, tmp_path_factory.mktemp("arrivals"), extra=["--rollfleet-arrival-wait-ms", "3600000"]
    ) as proc:
        yield proc


def test_a_request_queued_while_another_is_read_starts_with_it_in_one_batch(patient_server):
    server = patient_server
    before = stats(server)
    reading = HalfSent(server, {"input_ids": [1, 2, 3], "sampling_params": SHORT})
    try:
        wait_until(lambda: stats(server)["arriving_requests"] == 1, what="the half-sent request counted")
        queued = generate_in_background(server, {"input_ids": [4, 5], "sampling_params": {**SHORT, "n": 2}})
        held = wait_until(
            lambda: (s := stats(server))["waiting_requests"] == 2 and s,
            what="the second request queued",
            alive=lambda: not queued.done(),
            state=lambda: stats(server),
        )
        assert held["running_requests"] == 0 and held["arrival_holds"] == before["arrival_holds"] + 1
        assert held["batches"] == before["batches"]  # nothing started while the first is still read
        first = reading.finish()
    finally:
        reading.close()
    second = queued.result(timeout=120)
    assert len(first["output_ids"]) == 2 and [len(s["output_ids"]) for s in second] == [2, 2]
    after = stats(server)
    assert after["batches"] == before["batches"] + 1  # all three samples started together
    assert after["arriving_requests"] == 0


def test_a_request_that_never_finishes_arriving_holds_nobody_for_longer_than_the_wait(qwen3_server):
    """The shared server keeps the default wait (50 ms): a client that stalls mid-body delays the
    others by at most that, and its count ends when it goes away."""
    server = qwen3_server
    before = stats(server)
    stalled = HalfSent(server, {"input_ids": [1, 2, 3], "sampling_params": SHORT})
    try:
        wait_until(lambda: stats(server)["arriving_requests"] == 1, what="the stalled request counted")
        answer = httpx.post(server.url + "/generate", json={"input_ids": [4, 5], "sampling_params": SHORT}, timeout=120)
        assert answer.status_code == 200 and len(answer.json()["output_ids"]) == 2
        assert stats(server)["arrival_holds"] == before["arrival_holds"] + 1
    finally:
        stalled.close()
    wait_until(lambda: stats(server)["arriving_requests"] == 0, what="the closed request no longer counted")
