"""The zygote (rollfleet/engine/process/zygote.py) with real engine processes on CPU: a forked engine imports
nothing (its start breakdown says so), serves the model's greedy answer, is killed with its tp
follower and reaped (no zombie), comes back forked again; a zygote that is gone means a plain spawn,
and the engine's log says why. A sub-zygote of the run's shared zygote (what the fleets' workers
take) forks and reaps the same way and ends when its connection closes."""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx
import pytest
from conftest import reference_greedy, shared_zygote, wait_up

from rollfleet.engine.process.launch import EngineProcess, embedded_argv
from rollfleet.engine.process.zygote_client import SHARED_ZYGOTE_ENV, Zygote
from rollfleet.wire.net import free_port

PROMPT = [4, 8, 15, 16]


@pytest.fixture(scope="module")
def zygote(qwen3_dir, tmp_path_factory):
    zygote = Zygote(tmp_path_factory.mktemp("zygote") / "zygote.log", preload_model=qwen3_dir)
    yield zygote
    zygote.close()


def start(model_dir: str, log: Path, zygote: Zygote | None, tp_size: int = 1) -> EngineProcess:
    def launch() -> EngineProcess:
        port = free_port()
        return EngineProcess(embedded_argv(model_dir, port, tp_size=tp_size), port=port, log_path=log, zygote=zygote)

    return wait_up(launch(), launch, timeout=120)


def greedy(engine: EngineProcess) -> list[int]:
    body = {"input_ids": PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}}
    return httpx.post(f"{engine.url}/generate", json=body, timeout=60).json()["output_ids"]


def breakdown(engine: EngineProcess) -> dict:
    return httpx.get(f"{engine.url}/get_server_info", timeout=10).json()["start_breakdown"]


def is_zombie_or_gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.mark.parametrize("tp_size", [1, 2])
def test_a_killed_engine_comes_back_forked_with_no_imports(zygote, qwen3_dir, tmp_path, tp_size):
    assert zygote.ready.wait(120) and zygote.info["threads"] == ["python"]  # one thread: a fork is safe
    expected = reference_greedy(qwen3_dir, PROMPT, 6)[0]
    engine = start(qwen3_dir, tmp_path / "engine.log", zygote, tp_size)
    for attempt in range(2):  # the first start, then the restart after a kill
        start_split = breakdown(engine)
        assert engine.launch == "zygote" and start_split["launch"] == "zygote", start_split
        # imports and model code came with the fork (the zygote imported them): proven by how it was
        # launched and the launcher's log line below, not by the phases' seconds (a loaded machine's)
        assert len(start_split["followers"]) == tp_size - 1
        assert greedy(engine) == expected
        engine.kill()
        assert engine.proc.returncode == -9  # how it ended, as the zygote saw it when it reaped it
        assert is_zombie_or_gone(engine.pid)
        if attempt == 0:
            engine = start(qwen3_dir, tmp_path / "engine.log", zygote, tp_size)
    log = (tmp_path / "engine.log").read_text()
    # a start whose port was taken before it bound (errno 98) is launched again by `wait_up`: forked too
    launches = 2 + log.lower().count("errno 98")
    assert log.count("[launcher] engine pid") == launches and "(zygote):" in log
    assert log.count(f"forked by zygote pid {zygote.proc.pid}") == launches


def test_a_gone_zygote_means_a_spawn_and_the_log_says_why(qwen3_dir, tmp_path):
    zygote = Zygote(tmp_path / "zygote.log")
    zygote.proc.kill()
    zygote.proc.wait()
    engine = start(qwen3_dir, tmp_path / "engine.log", zygote)
    try:
        assert engine.launch == "spawn" and breakdown(engine)["launch"] == "spawn"
        assert breakdown(engine)["phases"]["imports"] > 0.1  # a new interpreter pays its imports
        assert "spawned, not forked (the zygote exited" in (tmp_path / "engine.log").read_text()
        assert greedy(engine) == reference_greedy(qwen3_dir, PROMPT, 6)[0]
    finally:
        engine.kill()


def test_a_sub_zygote_of_the_shared_one_forks_reaps_and_ends_with_its_connection(qwen3_dir, tmp_path):
    with pytest.raises(OSError):  # nothing listens there: the worker starts a zygote of its own
        Zygote.connect(tmp_path / "none.sock", tmp_path / "zygote.log")
    shared = shared_zygote()
    assert shared.ready.wait(120)
    sub = Zygote.connect(os.environ[SHARED_ZYGOTE_ENV], tmp_path / "zygote.log", preload_model=qwen3_dir)
    assert sub.ready.wait(60) and sub.info["threads"] == ["python"] and sub.pid != shared.pid
    engine = start(qwen3_dir, tmp_path / "engine.log", sub)
    start_split = breakdown(engine)
    assert engine.launch == "zygote" and start_split["launch"] == "zygote", start_split
    assert greedy(engine) == reference_greedy(qwen3_dir, PROMPT, 6)[0]
    engine.kill()
    assert engine.proc.returncode == -9 and is_zombie_or_gone(engine.pid)  # the sub-zygote reaped it
    assert f"forked by zygote pid {sub.pid}" in (tmp_path / "engine.log").read_text()
    sub.close()
    deadline = time.monotonic() + 30
    while not is_zombie_or_gone(sub.pid):  # it saw its connection close and exited
        assert time.monotonic() < deadline, "the sub-zygote outlived its connection"
        time.sleep(0.05)
    assert shared.is_alive()
