"""Shared fixtures: tiny models written in code, and real engine server processes on loopback."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import functools
import itertools
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import ray
import torch
from sleep_check import bare_sleeps
from transformers import AutoModelForCausalLM
from waits import WaitTimedOut, fleet_state, wait_until

from rollfleet.engine.process.launch import EngineProcess, PortInUse, embedded_argv
from rollfleet.engine.process.zygote_client import SHARED_ZYGOTE_ENV, Zygote
from rollfleet.fleet.placement import init_local_ray
from rollfleet.tiny_models import make_tiny_model, tiny_config
from rollfleet.weights.source import ModuleSource
from rollfleet.wire.client import EngineClient
from rollfleet.wire.net import free_port


def run(coro):
    return asyncio.run(coro)


def _plain_http(request):
    """httpx's module functions build a client per call, whose default SSL context loads the CA
    bundle: tens of ms of CPU per request (tens of seconds over the suite) that the tests' plain
    http:// requests to loopback servers never use. Each call still gets a client and a connection
    of its own; a call that passes `verify` keeps it."""

    @functools.wraps(request)
    def plain(*args, **kwargs):
        kwargs.setdefault("verify", False)
        return request(*args, **kwargs)

    return plain


httpx.get, httpx.post = _plain_http(httpx.get), _plain_http(httpx.post)


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


# ---- lent across modules -------------------------------------------------------------------------
# Starting Ray or an engine server costs seconds of CPU (a tp=2 engine about 15) on a 2-core machine.
# A Lender starts one when a test first needs it and lends it to the tests after it; the hooks below
# stop it at the end of the last module that asks for it (SHARED_UNTIL_LAST_MODULE) or, for Ray,
# which other modules start themselves, at the end of every run of modules that ask for it (the
# modules on it run one after the other).
class Lender:
    """Something expensive started on first use (`start(stack)` registers its own clean-up on the
    ExitStack and returns the thing) and kept until `release()`; a later `get()` starts it again."""

    def __init__(self, start):
        self._start, self._stack, self._value = start, None, None

    def get(self):
        if self._stack is None:
            with contextlib.ExitStack() as stack:  # a start that fails stops what it had started
                self._value = self._start(stack)
                self._stack = stack.pop_all()
        return self._value

    def release(self) -> None:
        stack, self._stack, self._value = self._stack, None, None
        if stack is not None:
            stack.close()


_LENDERS: dict[str, Lender] = {}  # session fixture name -> its lender, once a test asked for it
SHARED_UNTIL_LAST_MODULE = {"qwen3_server_lender", "weight_servers_lender"}
_LAST_MODULE: dict[str, str] = {}  # lender fixture name -> the last module whose tests ask for it
_MODULE_USES: dict[str, set[str]] = {}  # module -> the lender fixtures its tests ask for


def _module(item) -> str:
    return item.nodeid.split("::")[0]


@pytest.hookimpl(trylast=True)  # after -k / -m deselected what will not run
def pytest_collection_modifyitems(items):
    _refuse_bare_sleeps({Path(str(item.fspath)) for item in items})
    items[:] = _ray_modules_together(items)
    for item in items:
        _MODULE_USES.setdefault(_module(item), set()).update(n for n in item.fixturenames if n.endswith("_lender"))
        for name in SHARED_UNTIL_LAST_MODULE & set(item.fixturenames):
            _LAST_MODULE[name] = _module(item)


def _refuse_bare_sleeps(modules: set[Path]) -> None:
    """The run stops before any test when a test sleeps before it asserts or signals (sleep_check.py)."""
    helpers = [Path(__file__).parent / name for name in ("conftest.py", "waits.py", "helper_processes.py")]
    bare = [line for path in sorted(modules | set(helpers)) for line in bare_sleeps(path)]
    if bare:
        raise pytest.UsageError(
            "sleeps outside a polling loop (wait on an observable with tests/waits.py, or add the "
            "line's function to sleep_check.ALLOWED with the reason):\n  " + "\n  ".join(bare)
        )


def _ray_modules_together(items: list) -> list:
    """The modules on conftest's Ray moved up to the first of them (each keeps its own order), so
    one Ray start (about 10 s of CPU) serves them all."""
    on_ray = {_module(item) for item in items if "ray_lender" in item.fixturenames}
    first = next((i for i, item in enumerate(items) if _module(item) in on_ray), len(items))
    moved = [item for item in items[first:] if _module(item) in on_ray]
    rest = [item for item in items[first:] if _module(item) not in on_ray]
    return items[:first] + moved + rest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield  # the module's own fixtures (fleets on Ray, clients of a server) are torn down first
    if nextitem is not None and _module(nextitem) == _module(item):
        return
    for name, lender in _LENDERS.items():
        if name in SHARED_UNTIL_LAST_MODULE:
            done = _LAST_MODULE.get(name) == _module(item) or nextitem is None
        else:  # Ray: other modules call ray.init themselves, so it never outlives a run of its users
            done = nextitem is None or name not in _MODULE_USES.get(_module(nextitem), ())
        if done:
            lender.release()


def lend(name: str, start):
    """The body of a session fixture `name` whose value lives as the hooks above say."""
    lender = _LENDERS[name] = Lender(start)
    yield lender
    lender.release()


@pytest.fixture(scope="session")
def ray_lender():
    def start(stack):
        shared_zygote()  # listening before Ray's workers start engines (see SHARED_ZYGOTE_ENV)
        temp = tempfile.mkdtemp(prefix="rf-ray-")
        stack.callback(shutil.rmtree, temp, ignore_errors=True)
        init_local_ray(num_cpus=8, num_gpus=4, _temp_dir=temp)
        stack.callback(ray.shutdown)

    yield from lend("ray_lender", start)


@pytest.fixture
def gloo_world_of_one():
    """This process as a one-rank gloo world (an in-process trainer), for the test's length."""
    import torch.distributed as dist

    from rollfleet.train.sharding import init_distributed

    init_distributed(0, 1, master_port=free_port(), backend="gloo")
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def local_ray(ray_lender):
    """A local Ray told it has 4 GPUs (engines still run on the CPU), in a temp dir of its own; one
    Ray serves consecutive modules that ask for it (each module's fleets are shut down at its end)."""
    ray_lender.get()
    yield


@contextlib.contextmanager
def engine_server(model_path: str, log_dir, **kwargs):
    key = f"engine-{next(_SERVER_NUMBERS)}"  # its log's name: several may share a directory
    with engine_servers({key: (model_path, kwargs)}, log_dir) as procs:
        yield procs[key]


_SERVER_NUMBERS = itertools.count()


_ZYGOTE: Zygote | None = None
# its socket and log; gone after a green run. Named by the process, not random: test modules that
# `from conftest import ...` run this file a second time, and both copies must name one socket
# (made when the zygote starts: Ray workers that import a test module run this file too)
_ZYGOTE_DIR = Path(tempfile.gettempdir()) / f"rf-test-zygote-{os.getpid()}"
_ZYGOTE_SOCKET = _ZYGOTE_DIR / "zygote.sock"
# set before any Ray or subprocess starts, so that they inherit it: the engine workers of every
# fleet (and bench) of the run take a sub-zygote of the shared one where it listens by then
os.environ[SHARED_ZYGOTE_ENV] = str(_ZYGOTE_SOCKET)


def shared_zygote() -> Zygote:
    """One zygote for the whole run (started on first use, ended with pytest, whose pipe it reads):
    the tests' engines fork from it as a fleet's do (rollout.engine_launcher: zygote), so an engine
    start costs no imports (seconds of CPU each on this 2-core machine); it listens at
    ROLLFLEET_ZYGOTE_SOCKET, where the fleets' engine workers connect for a sub-zygote of it
    (workers started before it listens start their own). It also imports the tiny models' code
    (transformers' modeling modules and torch._dynamo, which either architecture pulls in: over a
    second of CPU per engine process otherwise, tp followers included). A zygote that died is
    replaced; EngineProcess spawns when a fork fails, saying so in the engine's log."""
    global _ZYGOTE
    if _ZYGOTE is None or not _ZYGOTE.is_alive():
        _ZYGOTE_DIR.mkdir(mode=0o700, exist_ok=True)
        _ZYGOTE = Zygote(_ZYGOTE_SOCKET.with_suffix(".log"), listen=_ZYGOTE_SOCKET, preload_model=_model_config_dir())
    return _ZYGOTE


@functools.cache
def _model_config_dir() -> str:
    """A directory with only a tiny qwen3 config.json (all the zygote's preload reads), for the run."""
    directory = tempfile.mkdtemp(prefix="rf-test-zygote-config-")
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    tiny_config("qwen3").save_pretrained(directory)
    return directory


def wait_up(proc: EngineProcess, again: Callable[[], EngineProcess], timeout: float, attempts: int = 3):
    """`proc` once it serves. When another process took its port before it bound it (PortInUse: the
    port was free when chosen; a starting engine's store takes ports too), `again()` starts one on
    another port, `attempts` in all."""
    for attempt in range(1, attempts + 1):
        try:
            proc.wait_until_up(timeout=timeout)
            return proc
        except PortInUse:
            if attempt == attempts:
                raise
            proc = again()


@contextlib.contextmanager
def engine_servers(plan: dict[str, tuple[str, dict]], log_dir):
    """Several servers, `plan` = key -> (model path, embedded_argv kwargs): all started (forked from
    the run's zygote), then waited for, so their loads overlap; key -> EngineProcess."""
    procs = {}

    def start(key) -> EngineProcess:
        path, kwargs = plan[key]
        port = free_port()
        procs[key] = EngineProcess(
            embedded_argv(path, port, **kwargs), port=port, log_path=log_dir / f"{key}.log", zygote=shared_zygote()
        )
        return procs[key]

    try:
        for key in plan:
            start(key)
        for key in plan:
            wait_up(procs[key], lambda key=key: start(key), timeout=180)
        yield procs
    finally:
        for proc in procs.values():
            proc.stop()


@pytest.fixture(scope="session")
def qwen3_server_lender(qwen3_dir, tmp_path_factory):
    def start(stack):
        return stack.enter_context(engine_server(qwen3_dir, tmp_path_factory.mktemp("qwen3-server")))

    yield from lend("qwen3_server_lender", start)


@pytest.fixture(scope="module")
def qwen3_server(qwen3_server_lender, qwen3_dir):
    """A plain tp=1 server of qwen3_dir shared by the modules that ask for it: each module gets it in
    a fresh server's state (qwen3_dir's weights, version "default", generating) and leaves it so."""
    proc = qwen3_server_lender.get()
    if not proc.is_alive():  # a module before killed it: a server of its own for this one
        qwen3_server_lender.release()
        proc = qwen3_server_lender.get()
    reset_server(proc, qwen3_dir)
    yield proc
    reset_server(proc, qwen3_dir)


def reset_server(proc: EngineProcess, model_dir: str) -> None:
    """Undo what a module may have left on a shared server (an open weight-update session, paused
    generation, released memory, other weights or version); the refusals of what was not there are
    expected."""
    for route, body in (
        ("/end_weight_update", {}),
        ("/abort_request", {"abort_all": True}),
        ("/continue_generation", {}),
    ):
        httpx.post(proc.url + route, json=body, timeout=60)
    released = call(proc, "get_server_info")["rollfleet_released_memory"]
    if released:  # exactly these: a resume of a tag not released is refused, and resumes nothing
        call(proc, "resume_memory_occupation", released)
    call(proc, "update_weights_from_disk", model_dir, weight_version="default")
    info = call(proc, "get_model_info")
    assert info["weights_ready"] and info["weight_version"] == "default", info


@pytest.fixture(scope="session")
def weight_servers_lender(qwen3_dir, qwen3_dir_b, moe_dir, moe_dir_b, tmp_path_factory):
    """tp=1 and tp=2 targets that start from dummy (qwen3) or their own (MoE) weights, and references
    started from qwen3_dir_b / moe_dir_b that no test changes (test_engine_tp, test_engine_weight_routes)."""
    plan = {
        "tp1": (qwen3_dir, {"load_format": "dummy"}),
        "tp2": (qwen3_dir, {"tp_size": 2, "load_format": "dummy"}),
        "ref1": (qwen3_dir_b, {}),
        "ref2": (qwen3_dir_b, {"tp_size": 2}),
        "moe": (moe_dir, {"tp_size": 2, "ep_size": 2}),
        "moe_ref": (moe_dir_b, {"tp_size": 2, "ep_size": 2}),
    }

    def start(stack):
        return stack.enter_context(engine_servers(plan, tmp_path_factory.mktemp("weight-servers")))

    yield from lend("weight_servers_lender", start)


@pytest.fixture(scope="module")
def weight_servers(weight_servers_lender) -> dict[str, EngineProcess]:
    return weight_servers_lender.get()


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


async def scheduler_stats_when(client: EngineClient, condition, timeout: float = 60, task=None) -> dict:
    """The scheduler stats a server reports (`/get_server_info`) once `condition` holds of them:
    waits on the server's own state, not on time. A `task` (the request the condition is about)
    that ends first fails the wait at once with what it returned; a dead server fails the call."""
    deadline = time.monotonic() + timeout
    while True:
        stats = (await client.get_server_info())["scheduler_stats"]
        if condition(stats):
            return stats
        assert task is None or not task.done(), f"the request ended before the wait was met: {task.result()}"
        if time.monotonic() >= deadline:
            raise WaitTimedOut(f"not reached within {timeout} s: {stats}")
        await asyncio.sleep(0.005)


async def held_in_flight(client: EngineClient, steps: int = 1, samples: int = 1, **generate) -> asyncio.Task:
    """A request made to be mid-generation, as a state instead of a race: the engine paused in place,
    the request queued (`samples` sequences), then `steps` steps run (its prefill, then decode
    steps), so its sequences hold `steps` tokens each and cannot finish until continue_generation
    (ask for more tokens than `steps`: a request that ended within them fails the helper)."""
    await client.pause_generation("in_place")
    before = (await client.get_server_info())["scheduler_stats"]["waiting_requests"]
    task = asyncio.create_task(client.generate(**generate))
    await scheduler_stats_when(client, lambda s: s["waiting_requests"] >= before + samples, task=task)
    answer = await client.step(steps)
    assert answer["steps_run"] == steps and answer["scheduler_stats"]["running_requests"] >= 1, answer
    return task


async def engine_turns(client: EngineClient, turns: int = 2) -> None:
    """Returns once the engine thread has chosen its next work `turns` times (each a control through
    its queue): a request that could have started would have by then (controls and batches share
    one loop), so "still waiting" after it is held, not slow."""
    for _ in range(turns):
        await client.memory()


def pause_engine(fleet, engine_id: int) -> None:
    """Pause a fleet's engine in place: before the generate that `hold_with_requests` waits on starts,
    or a fast generate may be over before the pause lands."""
    fleet.pool.call(engine_id, "pause_generation", "in_place")


def hold_with_requests(fleet, engine_id: int, *, alive, steps: int = 0) -> dict:
    """With the engine paused (`pause_engine`, before the caller's generate started), wait (while
    `alive()`, that generate) until the router has queued requests on it, then let it run `steps`
    steps: its requests are in flight by construction, neither finished nor started by luck. Returns
    its scheduler stats then."""
    pause_engine(fleet, engine_id)  # already paused: changes nothing
    wait_until(
        lambda: fleet.pool.call(engine_id, "get_server_info")["scheduler_stats"]["waiting_requests"],
        what=f"requests queued on engine {engine_id}",
        alive=alive,
        state=lambda: fleet_state(fleet),
    )
    if steps:
        return fleet.pool.call(engine_id, "step", steps)["scheduler_stats"]
    return fleet.pool.call(engine_id, "get_server_info")["scheduler_stats"]


_AGAIN = itertools.count()


def serving_again(fleet, module) -> None:
    """Every engine of a module-scoped fleet ACTIVE at the fleet's version, whatever a test before
    left: a dead one restarted (past any backoff) and restored, a waiting one (a failed push) given
    a push of `module`. Each test sets up the state it asserts on, so it passes alone and in any order."""
    if any(s.state.value == "INACTIVE" for s in fleet.slots):
        fleet.restart_inactive(force=True)
    if any(s.state.value != "ACTIVE" or s.version != fleet.version for s in fleet.slots):
        fleet.sync_weights(ModuleSource(module), f"again-{next(_AGAIN)}")
    states = [(s.state.value, s.version) for s in fleet.slots]
    assert states == [("ACTIVE", fleet.version)] * len(fleet.slots), states


def kill(fleet, engine_id: int) -> float:
    """SIGKILL an engine's process group (its tp followers too); returns when it was sent."""
    os.killpg(ray.get(fleet.slots[engine_id].head.engine_pid.remote()), signal.SIGKILL)
    return time.monotonic()


def stop(fleet, engine_id: int) -> None:
    """Hang the engine: its process lives but answers nothing."""
    os.killpg(ray.get(fleet.slots[engine_id].head.engine_pid.remote()), signal.SIGSTOP)


class FailsAfter:
    """A source that raises after yielding `count` tensors (a trainer rank dying mid-push)."""

    def __init__(self, module, count: int):
        self.inner, self.count = ModuleSource(module), count

    def named_tensors(self):
        for index, item in enumerate(self.inner.named_tensors()):
            if index == self.count:
                raise RuntimeError("source failed part-way")
            yield item


def pytest_sessionfinish(session, exitstatus):
    """The shared zygote's folder goes with a green run; a red one keeps its log, and says where."""
    if exitstatus == 0:
        shutil.rmtree(_ZYGOTE_DIR, ignore_errors=True)
    else:
        print(f"\nthe shared zygote's log: {_ZYGOTE_SOCKET.with_suffix('.log')}")
