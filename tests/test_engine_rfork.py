"""R-Fork (SGLang's load-weights-from-a-running-engine) between real embedded engine processes on CPU:
restore at start (tp 1 and 2), a standby's pull, refusals at the door and before any broadcast, and
bounded failures on both sides (a seed stopped mid-transfer, a destination that never joins)."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import threading
import time

import httpx
import pytest
from conftest import call, engine_server, engine_servers, run, shared_zygote
from waits import wait_until

from rollfleet.engine.process.launch import EngineProcess, EngineStartError, RemoteSeed, embedded_argv
from rollfleet.tiny_models import make_tiny_model
from rollfleet.wire.client import EngineClient, EngineError
from rollfleet.wire.net import free_port

TIMEOUT = ["--rollfleet-remote-instance-timeout-s", "4"]
GREEDY = {"input_ids": [5, 6, 7, 8], "sampling_params": {"temperature": 0, "max_new_tokens": 8}}


def seed_of(proc, tp: int) -> RemoteSeed:
    return RemoteSeed("127.0.0.1", proc.port, tuple(free_port() for _ in range(tp)))


def same_weights(a, b) -> None:
    """Equal fingerprints (the fleet's check), equal shards per rank, equal versions, equal greedy tokens."""
    assert call(a, "weights_fingerprint") == call(b, "weights_fingerprint")
    assert call(a, "shard_fingerprints") == call(b, "shard_fingerprints")
    assert call(a, "get_model_info")["weight_version"] == call(b, "get_model_info")["weight_version"]
    assert call(a, "generate", **GREEDY)["output_ids"] == call(b, "generate", **GREEDY)["output_ids"]


def last_load(proc) -> dict:
    return call(proc, "get_server_info")["rollfleet_remote_instance"]["last_load"]


@pytest.fixture(scope="module")
def seeds(qwen3_dir, tmp_path_factory):
    """A tp=1 and a tp=2 seed serving qwen3_dir at version v7."""
    extra = ["--weight-version", "v7", *TIMEOUT]
    plan = {"tp1": (qwen3_dir, {"extra": extra}), "tp2": (qwen3_dir, {"tp_size": 2, "extra": extra})}
    with engine_servers(plan, tmp_path_factory.mktemp("seeds")) as procs:
        yield procs


def test_restore_at_start_tp1_and_tp2(seeds, qwen3_dir_b, tmp_path):
    """Destinations built from another model's directory (same architecture, other weights) end up
    with the seed's weights and version: nothing came from their own disk."""
    plan = {
        f"tp{tp}": (qwen3_dir_b, {"tp_size": tp, "extra": seed_of(seeds[f"tp{tp}"], tp).argv() + TIMEOUT})
        for tp in (1, 2)
    }
    for key in plan:  # embedded_argv's own --load-format comes first; the seed's flags override it
        assert plan[key][1]["extra"][:2] == ["--load-format", "remote_instance"]
    with engine_servers(plan, tmp_path) as dests:
        for tp in (1, 2):
            load = last_load(dests[f"tp{tp}"])
            assert load["status"] == "loaded" and list(load["phases"]) == ["layout", "join", "transfer", "check"]
            assert sum(load["phases"].values()) <= load["seconds"] + 0.01
            assert call(dests[f"tp{tp}"], "get_model_info")["weight_version"] == "v7"
            same_weights(seeds[f"tp{tp}"], dests[f"tp{tp}"])


def test_refusals_at_the_door(seeds):
    seed = seeds["tp1"]
    bad = [
        ({"ports": "29600,x"}, "ports"),
        ({"ports": "29600,29601"}, "tp_size=1"),  # two ports for one rank
        ({"group_rank": 1}, "group_rank"),
        ({"world_size": 3}, "world_size"),
        ({"backend": "mpi"}, "backend"),
    ]
    for change, named in bad:
        body = {"master_address": "127.0.0.1", "ports": "29600", "group_rank": 0, "world_size": 2, **change}
        response = httpx.post(f"{seed.url}/init_weights_send_group_for_remote_instance", json=body, timeout=30)
        assert response.status_code == 400 and named in response.json()["message"], (change, response.text)
    with pytest.raises(EngineError, match="call /init_weights_send_group_for_remote_instance first") as err:
        call(seed, "send_weights_to_remote_instance", "127.0.0.1", [free_port()], group_name="never_joined")
    assert err.value.status_code == 400
    assert call(seed, "get_server_info")["rollfleet_remote_instance"]["seed"] == {"serving": None, "stage": None}


def test_destination_that_never_joins(seeds):
    """The seed's init fails within its timeout; a second destination meanwhile is told the seed is
    busy; afterwards the seed serves generate at its version with its weights untouched."""
    seed = seeds["tp1"]
    before = call(seed, "weights_fingerprint")

    async def go():
        async with EngineClient(seed.url, timeout=60) as client:
            first = asyncio.ensure_future(
                client.init_weights_send_group_for_remote_instance("127.0.0.1", [free_port()])
            )
            deadline = time.monotonic() + 60
            while (await client.get_server_info())["rollfleet_remote_instance"]["seed"]["stage"] != "joining":
                assert not first.done(), f"the init ended before the seed was seen joining: {first.exception()!r}"
                assert time.monotonic() < deadline, "the seed never reached 'joining'"
                await asyncio.sleep(0.01)
            with pytest.raises(EngineError, match="busy") as busy:
                await client.init_weights_send_group_for_remote_instance("127.0.0.1", [free_port()], group_name="other")
            assert busy.value.status_code == 409
            with pytest.raises(EngineError, match="not joined within 4 s"):  # the seed's own timeout ended it
                await first

    run(go())
    answer = call(seed, "generate", **GREEDY)
    assert answer["meta_info"]["weight_version"] == "v7" and len(answer["output_ids"]) == 8
    assert call(seed, "weights_fingerprint") == before


@pytest.fixture(scope="module")
def standby(qwen3_dir_b, tmp_path_factory):
    """A running tp=1 engine without weights (dummy start), as a fleet's warm standby."""
    with engine_server(qwen3_dir_b, tmp_path_factory.mktemp("standby"), load_format="dummy", extra=TIMEOUT) as proc:
        yield proc


def test_mismatch_refused_before_any_broadcast(seeds, standby, tmp_path):
    wider = make_tiny_model(tmp_path / "wider", "qwen3", seed=0, intermediate_size=96)
    before = call(standby, "get_model_info")  # not ready, unless the pull test ran first
    with engine_server(str(wider), tmp_path, extra=TIMEOUT) as other:
        for seed, named in ((seeds["tp2"], "tp_size: seed 2, this engine 1"), (other, "parameters differ")):
            with pytest.raises(EngineError, match="refused before any broadcast") as err:
                call(standby, "load_from_remote_instance", "127.0.0.1", seed.port, [free_port()], timeout_s=4)
            assert named in err.value.message
            assert call(seed, "get_server_info")["rollfleet_remote_instance"]["seed"]["stage"] is None
    after = call(standby, "get_model_info")  # the refusals changed nothing on the destination
    assert (after["weights_ready"], after["weight_version"]) == (before["weights_ready"], before["weight_version"])


def test_standby_pulls_from_a_seed(seeds, standby):
    with pytest.raises(EngineError, match="weights are not loaded"):
        call(standby, "generate", **GREEDY)
    answer = call(standby, "load_from_remote_instance", "127.0.0.1", seeds["tp1"].port, [free_port()], timeout_s=4)
    assert answer["weight_version"] == "v7"
    same_weights(seeds["tp1"], standby)


def test_seed_stopped_mid_transfer(tmp_path):
    """A seed SIGSTOPped while it sends: the destination's pull fails within its timeout, it stays up
    but not ready with the reason; a disk load makes it ready; the seed, continued, still serves and
    seeds a second pull. Also measures a peer restore against a disk load of the same ~128 MB model."""
    big = str(make_tiny_model(tmp_path / "big", "qwen3", seed=3, **BIG))
    plan = {"seed": (big, {"extra": TIMEOUT}), "dest": (big, {"load_format": "dummy", "extra": TIMEOUT})}
    with engine_servers(plan, tmp_path) as procs:
        seed, dest = procs["seed"], procs["dest"]
        outcome = {}
        pull = threading.Thread(target=lambda: outcome.update(answer=_pull(dest, seed)))
        pull.start()
        wait_until(
            lambda: call(seed, "get_server_info")["rollfleet_remote_instance"]["seed"]["stage"] == "sending",
            what="the seed sending",
            alive=pull.is_alive,  # a pull that ended first fails here, at once, instead of hanging the suite
            interval=0.002,
        )
        os.kill(seed.pid, signal.SIGSTOP)
        try:
            pull.join(timeout=60)
            assert not pull.is_alive()
            failure = outcome["answer"]
            assert isinstance(failure, EngineError) and "receive" in failure.message, failure
            assert last_load(dest)["status"] == "failed"
            with pytest.raises(EngineError, match="weights are not loaded") as err:
                call(dest, "generate", **GREEDY)
            assert err.value.status_code == 503 and "loading them from the seed" in err.value.message
        finally:
            os.kill(seed.pid, signal.SIGCONT)
        assert call(seed, "generate", **GREEDY)["meta_info"]["weight_version"] == "default"
        start = time.perf_counter()
        call(dest, "update_weights_from_disk", big)
        disk_s = time.perf_counter() - start
        assert call(dest, "get_model_info")["weights_ready"] is True
        start = time.perf_counter()
        assert not isinstance(_pull(dest, seed), Exception)
        peer_s = time.perf_counter() - start
        same_weights(seed, dest)
        print(f"\n~128 MB model on CPU: peer restore {peer_s:.2f} s, disk load {disk_s:.2f} s")


BIG = dict(hidden_size=1024, intermediate_size=4096, num_attention_heads=8, num_key_value_heads=4, head_dim=128)


def _pull(dest, seed):
    try:
        return call(dest, "load_from_remote_instance", "127.0.0.1", seed.port, [free_port()], timeout_s=4)
    except EngineError as exc:
        return exc


def test_an_engine_that_never_comes_up_says_where_each_of_its_processes_waits(qwen3_dir_b, tmp_path):
    """A tp=2 destination whose seed accepts the connection and never answers stays starting; the
    launcher's timeout asks its processes for their stacks (SIGUSR1) and the error shows them."""
    silent = socket.create_server(("127.0.0.1", 0))  # listens, never accepts: the engine's call hangs
    try:
        seed = RemoteSeed("127.0.0.1", silent.getsockname()[1], (free_port(), free_port()))
        port = free_port()
        argv = embedded_argv(
            qwen3_dir_b, port, tp_size=2, extra=seed.argv() + ["--rollfleet-remote-instance-timeout-s", "200"]
        )
        log = tmp_path / "stuck.log"
        proc = EngineProcess(argv, port=port, log_path=log, zygote=shared_zygote())
        # the pool's line comes after both ranks built their model (and registered their stack dump)
        wait_until(
            lambda: "paged KV pool" in log.read_text(errors="replace"),
            what="the engine built",
            timeout=120,
            alive=proc.is_alive,
        )
        with pytest.raises(EngineStartError) as err:
            proc.wait_until_up(timeout=0)
    finally:
        silent.close()
    assert "(most recent call first):" in str(err.value), err.value  # the launcher waited for a dump

    # both processes' stacks: the follower waits for its leader's next action, the leader on the seed
    def both() -> str | None:
        text = log.read_text(errors="replace")
        return text if "lockstep.py" in text and "remote_pull.py" in text else None

    stacks = wait_until(
        both,
        what="the leader's and the follower's stacks in the log",
        timeout=60,
        state=lambda: log.read_text(errors="replace")[-3000:],
    )
    assert stacks.count("(most recent call first):") >= 2
    assert not proc.is_alive()
