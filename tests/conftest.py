"""Shared fixtures: tiny models written in code, and real engine server processes on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import shutil
import tempfile
import time

import pytest
import ray
import torch
from transformers import AutoModelForCausalLM

from rollfleet.engine.launch import EngineProcess, PortInUse, embedded_argv
from rollfleet.tiny_models import make_tiny_model
from rollfleet.wire.client import EngineClient
from rollfleet.wire.net import free_port


def run(coro):
    return asyncio.run(coro)


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("qwen3"), "qwen3", seed=0))


@pytest.fixture(scope="session")
def qwen3_dir_b(tmp_path_factory):
    """Same architecture as qwen3_dir, other weights."""
    return str(make_tiny_model(tmp_path_factory.mktemp("qwen3b"), "qwen3", seed=1))


@pytest.fixture(scope="session")
def moe_dir(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("moe"), "qwen3_moe", seed=0))


@pytest.fixture(scope="session")
def moe_dir_b(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("moeb"), "qwen3_moe", seed=1))


@pytest.fixture(scope="module")
def local_ray():
    """A local Ray told it has 4 GPUs (engines still run on the CPU), in a temp dir of its own."""
    temp = tempfile.mkdtemp(prefix="rf-ray-")
    ray.init(num_cpus=8, num_gpus=4, _temp_dir=temp, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()
    shutil.rmtree(temp, ignore_errors=True)


@contextlib.contextmanager
def engine_server(model_path: str, log_dir, **kwargs):
    key = f"engine-{next(_SERVER_NUMBERS)}"  # its log's name: several may share a directory
    with engine_servers({key: (model_path, kwargs)}, log_dir) as procs:
        yield procs[key]


_SERVER_NUMBERS = itertools.count()


@contextlib.contextmanager
def engine_servers(plan: dict[str, tuple[str, dict]], log_dir):
    """Several servers, `plan` = key -> (model path, embedded_argv kwargs): all started, then waited
    for, so their loads overlap; key -> EngineProcess."""
    procs = {}

    def start(key):
        path, kwargs = plan[key]
        port = free_port()
        procs[key] = EngineProcess(embedded_argv(path, port, **kwargs), port=port, log_path=log_dir / f"{key}.log")

    try:
        for key in plan:
            start(key)
        for key in plan:
            for attempt in range(3):
                try:
                    procs[key].wait_until_up(timeout=180)
                    break
                except PortInUse:  # another process (a starting engine's store) took the port meanwhile
                    if attempt == 2:
                        raise
                    start(key)
        yield procs
    finally:
        for proc in procs.values():
            proc.stop()


def client_for(proc: EngineProcess, **kwargs) -> EngineClient:
    return EngineClient(proc.url, timeout=60, **kwargs)


def call(proc: EngineProcess, method: str, *args, **kwargs):
    """One client call against a server, from sync test code."""

    async def go():
        async with client_for(proc, api_key=kwargs.pop("api_key", None)) as client:
            return await getattr(client, method)(*args, **kwargs)

    return run(go())


def every_engine(fleet, verb: str, *args, **kwargs) -> list:
    """One client call on every engine of a fleet, through its engine pool; answers by engine id."""
    return fleet.pool.on_all(verb, [s.engine_id for s in fleet.slots], *args, **kwargs)


@functools.lru_cache(maxsize=4)
def _reference_model(model_path: str):
    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()


def reference_greedy(model_path: str, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy tokens and their logprobs from a plain transformers forward pass (no engine involved)."""
    model = _reference_model(model_path)
    ids = list(prompt_ids)
    out, logprobs = [], []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            token = int(torch.argmax(logits))
            out.append(token)
            logprobs.append(float(torch.log_softmax(logits, -1)[token]))
            ids.append(token)
    return out, logprobs


async def scheduler_stats_when(client: EngineClient, condition, timeout: float = 30) -> dict:
    """The scheduler stats a server reports (`/get_server_info`) once `condition` holds of them:
    waits on the server's own state, not on time."""
    deadline = time.monotonic() + timeout
    while True:
        stats = (await client.get_server_info())["scheduler_stats"]
        if condition(stats):
            return stats
        assert time.monotonic() < deadline, f"not reached within {timeout} s: {stats}"
        await asyncio.sleep(0.005)
