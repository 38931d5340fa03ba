"""Start and stop one engine server process (embedded or SGLang), with its log in a file.

`EngineProcess` runs an argv in its own process group (so a stop also ends its tp followers),
writes stdout and stderr to one log file per engine, and when the process dies before it is up,
raises with the last lines of that log. Given a zygote (zygote.py), an embedded engine is forked
from it (no imports to pay); when the zygote cannot fork, the engine is spawned and the log says why.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import httpx

from rollfleet.engine.process.start_timing import spawn_env
from rollfleet.engine.process.zygote_client import Zygote, ZygoteGone
from rollfleet.wire.remote_instance import LOAD_FORMAT, ports_flag

log = logging.getLogger("rollfleet.launch")


class EngineStartError(RuntimeError):
    pass


class PortInUse(EngineStartError):
    """The server lost its port to another process between our pick and its bind: pick again."""


PORT_IN_USE_MARKERS = ("address already in use", "errno 98")
# Until the port listens a poll is a refused connection (well under a millisecond): poll often, so
# an engine that is up is seen up at once (it was 0.2 s, on average 0.1 s of every start).
UP_POLL_S = 0.02


def embedded_argv(
    model_path: str,
    port: int,
    *,
    host: str = "127.0.0.1",
    tp_size: int = 1,
    ep_size: int = 1,
    load_format: str = "auto",
    api_key: str | None = None,
    admin_api_key: str | None = None,
    extra: list[str] | None = None,
) -> list[str]:
    argv = [
        sys.executable,
        "-m",
        "rollfleet.engine.process.server",
        "--model-path",
        model_path,
        "--host",
        host,
        "--port",
        str(port),
        "--tp-size",
        str(tp_size),
        "--ep-size",
        str(ep_size),
        "--load-format",
        load_format,
    ]
    return argv + key_argv(api_key, admin_api_key) + list(extra or [])


def key_argv(api_key: str | None, admin_api_key: str | None) -> list[str]:
    """The same flags for SGLang and the embedded engine."""
    return (["--api-key", api_key] if api_key else []) + (["--admin-api-key", admin_api_key] if admin_api_key else [])


@dataclass(frozen=True)
class RemoteSeed:
    """A running engine of the same layout to load weights from at start (SGLang's R-Fork):
    `group_ports` holds one port per tp rank, free on the seed's host (its ranks serve the groups)."""

    host: str
    port: int
    group_ports: tuple[int, ...]

    def argv(self) -> list[str]:
        """The same flags for SGLang and the embedded engine."""
        return [
            "--load-format",
            LOAD_FORMAT,
            "--remote-instance-weight-loader-seed-instance-ip",
            self.host,
            "--remote-instance-weight-loader-seed-instance-service-port",
            str(self.port),
            "--remote-instance-weight-loader-send-weights-group-ports",
            ports_flag(self.group_ports),
        ]


@dataclass(frozen=True)
class EngineLaunch:
    """Everything one engine server needs that differs between engines of a fleet."""

    port: int
    base_gpu_id: int = 0
    host: str = "127.0.0.1"
    load_format: str = "auto"  # "dummy": start with random weights, restore them afterwards
    seed: RemoteSeed | None = None  # load the weights from this engine instead (overrides load_format)

    def load_argv(self) -> list[str]:
        return self.seed.argv() if self.seed is not None else ["--load-format", self.load_format]


def sglang_argv(rollout, launch: EngineLaunch) -> list[str]:
    """`python -m sglang.launch_server ...` (or `rollout.sglang_command ...`) for one engine of the
    fleet (one server per dp replica)."""
    argv = [
        *(rollout.sglang_command or [sys.executable, "-m", "sglang.launch_server"]),
        "--model-path",
        rollout.model_path,
        "--host",
        launch.host,
        "--port",
        str(launch.port),
        "--tp-size",
        str(rollout.tp_size),
        "--pp-size",
        str(rollout.pp_size),
        "--ep-size",
        str(rollout.ep_size),
        "--base-gpu-id",
        str(launch.base_gpu_id),
        *launch.load_argv(),
    ]
    if rollout.placement == "colocated":
        argv.append("--enable-memory-saver")  # release/resume of weights and KV cache around training
    return argv + key_argv(rollout.api_key, rollout.admin_api_key) + list(rollout.server_extras)


def embedded_fleet_argv(rollout, launch: EngineLaunch) -> list[str]:
    seed_flags = launch.seed.argv()[2:] if launch.seed is not None else []  # after the load format
    extra = ["--base-gpu-id", str(launch.base_gpu_id), *seed_flags, *rollout.server_extras]
    return embedded_argv(
        rollout.model_path,
        launch.port,
        host=launch.host,
        tp_size=rollout.tp_size,
        ep_size=rollout.ep_size,
        load_format=LOAD_FORMAT if launch.seed is not None else launch.load_format,
        api_key=rollout.api_key,
        admin_api_key=rollout.admin_api_key,
        extra=extra,
    )


# The only place the two backends differ: how their server is started.
BACKEND_ARGV = {"embedded": embedded_fleet_argv, "sglang": sglang_argv}


def engine_argv(rollout, launch: EngineLaunch) -> list[str]:
    return BACKEND_ARGV[rollout.backend](rollout, launch)


def engine_env(gpu_ids: list[str]) -> dict[str, str]:
    """The server's environment: this process's, with only the engine's GPUs visible."""
    env = dict(os.environ)
    if gpu_ids:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpu_ids)
    return env


STACK_TAIL_LINES = 120  # an engine's stacks (leader and followers) come with a start that timed out
STACK_DUMP_WAIT_S = 10.0  # at most: a process too starved to run its handler
STACK_HEADER = "(most recent call first):"  # faulthandler's line before each thread's stack


def _log_text(path: Path) -> str:
    try:
        return Path(path).read_text(errors="replace")
    except OSError:
        return ""


def log_tail(path: Path, lines: int = 30) -> str:
    try:
        with open(path, errors="replace") as handle:
            return "".join(deque(handle, maxlen=lines))
    except OSError:
        return "(no log)"


class EngineProcess:
    def __init__(
        self,
        argv: list[str],
        *,
        port: int,
        log_path: str | Path,
        env: dict[str, str] | None = None,
        host: str = "127.0.0.1",
        zygote: Zygote | None = None,
        zygote_wait_s: float = 120.0,
    ):
        self.argv, self.port, self.host = argv, port, host
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.up_after_s: float | None = None  # spawn to the first /health answer, once seen
        self._spawned = time.monotonic()
        self.launch, how = "spawn", "spawned"
        if zygote is not None:
            try:
                # the spawn time in the environment: the engine reports its start from it (start_timing.py)
                self.proc = zygote.fork(argv, spawn_env(env), self.log_path, timeout=zygote_wait_s)
                self.launch, how = "zygote", f"forked by zygote pid {zygote.pid}"
            except ZygoteGone as why:
                how = f"spawned, not forked ({why})"
                log.warning("engine on port %d %s", port, how)
        if self.launch == "spawn":
            with open(self.log_path, "ab") as out:
                self.proc = subprocess.Popen(
                    argv, stdout=out, stderr=subprocess.STDOUT, env=spawn_env(env), start_new_session=True
                )
        with open(self.log_path, "a") as out:  # which process writes what follows, and how it started
            out.write(f"[launcher] engine pid {self.proc.pid} {how}: {' '.join(argv)}\n")

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host
        return f"http://{host}:{self.port}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def is_alive(self) -> bool:
        return self.proc.poll() is None

    def wait_until_up(
        self, timeout: float, poll_s: float = UP_POLL_S, *, answer_timeout: float = 2.0, silent_polls: int = 3
    ) -> None:
        """Block until /health answers; raise EngineStartError with the log's tail if the process dies,
        if it is not up by `timeout`, or if it listens but leaves `silent_polls` polls in a row
        unanswered for `answer_timeout` each (the fleet passes its health probes' settings). Our server
        binds its port last, when it is ready to answer: one that takes the connection and stays
        silent is hung (a stopped process too: the kernel still takes connections for it), and waiting
        out the start timeout (minutes on a GPU) would only delay its replacement."""
        deadline, silent = time.monotonic() + timeout, 0
        # One client for every poll: `httpx.get` builds a client (and its SSL context) per call, tens
        # to hundreds of milliseconds of CPU that a starting engine on the same cores also needs.
        with httpx.Client(timeout=answer_timeout) as client:
            while time.monotonic() < deadline:
                self._raise_if_dead()
                try:
                    if client.get(f"{self.url}/health").status_code in (200, 401) and self._serves_the_port(client):
                        self.up_after_s = time.monotonic() - self._spawned
                        return
                    silent = 0
                except httpx.ReadTimeout:  # connected, asked, no answer
                    silent += 1
                    if silent >= silent_polls:
                        self._fail_start(f"listens but left {silent} polls unanswered ({answer_timeout:g} s each)")
                    continue
                except httpx.TransportError:  # not listening yet
                    silent = 0
                time.sleep(poll_s)
        self._fail_start(f"not up after {timeout:.0f} s")

    def _fail_start(self, why: str) -> None:
        """Kill an engine that did not come up and raise EngineStartError saying `why`, with the log's
        tail and, unless the process is stopped, its processes' stacks."""
        stopped = self.is_stopped()
        if not stopped:
            self._dump_stacks()
        # killed, not stopped politely: an engine that never came up has nothing to shut down, and one
        # that hangs would hold the restart for the whole grace
        self.kill()
        stacks = "with its processes' stacks"
        if stopped:
            stacks = "stopped (SIGSTOP or a debugger): no stacks"
        raise EngineStartError(
            f"engine {why}; last lines of {self.log_path} ({stacks}):\n"
            f"{log_tail(self.log_path, lines=STACK_TAIL_LINES)}"
        )

    def is_stopped(self) -> bool:
        """Whether the engine's process is stopped (state T: SIGSTOP, or a debugger's trace): it runs
        no signal handler until continued."""
        try:
            stat = Path(f"/proc/{self.proc.pid}/stat").read_text()
        except OSError:  # gone, or no /proc (macOS)
            return False
        return stat.rsplit(")", 1)[1].split()[0] in ("T", "t")

    def _dump_stacks(self) -> None:
        """Ask every process of the engine for its threads' stacks (SIGUSR1: the server registers it
        with faulthandler), so an engine that never came up says where it was; they land in its log.
        Returns once a stack is in the log and the log has stopped growing (at most STACK_DUMP_WAIT_S)."""
        if not self.is_alive():
            return
        before = _log_text(self.log_path).count(STACK_HEADER)
        self._signal_group(signal.SIGUSR1)
        deadline, size = time.monotonic() + STACK_DUMP_WAIT_S, -1
        while time.monotonic() < deadline:
            text = _log_text(self.log_path)
            if text.count(STACK_HEADER) > before and len(text) == size:  # dumped, and nothing more came
                return
            size = len(text)
            time.sleep(0.1)

    def _serves_the_port(self, client: httpx.Client) -> bool:
        """Whether the server answering on our port is this process: another process may have taken
        the port between its choice and our bind (ours then exits with "address in use": PortInUse).
        Only the embedded engine says its pid; SGLang's answer, or a 401, is taken as ours."""
        answer = client.get(f"{self.url}/get_server_info")
        pid = answer.json().get("rollfleet_pid") if answer.status_code == 200 else None
        return pid is None or pid == self.proc.pid

    def _raise_if_dead(self) -> None:
        if self.is_alive():
            return
        tail = log_tail(self.log_path)
        error = PortInUse if any(m in tail.lower() for m in PORT_IN_USE_MARKERS) else EngineStartError
        raise error(
            f"engine exited with code {self.proc.returncode} before it was up; last lines of {self.log_path}:\n{tail}"
        )

    def kill(self) -> None:
        """Kill the whole process group at once (what a crash looks like)."""
        self._signal_group(signal.SIGKILL)
        self.proc.wait()

    def stop(self, grace: float = 10.0) -> None:
        if not self.is_alive():
            return
        self._signal_group(signal.SIGTERM)
        self._signal_group(signal.SIGCONT)  # a stopped process acts on the SIGTERM only once continued
        try:
            self.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            self.kill()

    def _signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass
