"""The launcher's side of the zygote (zygote.py): start one, ask it for engines, follow their exits.

A `Zygote` is owned by the process that launches engines (a fleet's engine-head worker). It starts
`python -m rollfleet.engine.process.zygote` with a pipe to its stdin (so the zygote ends when its owner
does) and reads its answers on one thread. `fork(argv, env, log)` returns a `ForkedProcess`, which
answers like `subprocess.Popen` (pid, poll, wait, returncode) although the engine is the zygote's
child, not ours: its exit is seen through a pidfd, its exit code comes from the zygote that reaped it.

`Zygote.connect(socket_path, log_path)` is the same launcher served by a sub-zygote of a shared
zygote of this host (`python -m rollfleet.engine.process.zygote --listen SOCKET`): no imports to wait for.
"""

from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

ENGINE_MODULE = ["-m", "rollfleet.engine.process.server"]
SHARED_ZYGOTE_ENV = "ROLLFLEET_ZYGOTE_SOCKET"  # where a shared zygote of this host listens, if one does
UNKNOWN_EXIT_CODE = -1  # the zygote that reaped the engine is gone before it said how it ended


class ZygoteGone(RuntimeError):
    """The zygote cannot fork now (it exited, is not ready in time, or refused): spawn instead."""


class Zygote:
    def __init__(self, log_path: str | Path, *, preload_model: str | None = None, listen: str | Path | None = None):
        """A zygote of our own; with `listen`, it also serves launchers that `connect` to that socket."""
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        argv = [sys.executable, "-m", "rollfleet.engine.process.zygote"]
        if preload_model:
            argv += ["--preload-model", preload_model]
        if listen:
            argv += ["--listen", str(listen)]
        env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}  # numpy's BLAS pool would be a thread at fork time
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env)
        self._begin(self.proc.stdout, self.proc.stdin)

    @classmethod
    def connect(cls, socket_path: str | Path, log_path: str | Path, *, preload_model: str | None = None) -> Zygote:
        """A sub-zygote of the shared zygote listening at `socket_path`; OSError when none listens."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(str(socket_path))
            sock.sendall((json.dumps({"preload_model": preload_model}) + "\n").encode())
        except OSError:
            sock.close()
            raise
        zygote = cls.__new__(cls)
        zygote.log_path, zygote.proc, zygote._sock = Path(log_path), None, sock
        zygote._begin(sock.makefile("rb"), sock.makefile("wb"))
        return zygote

    @classmethod
    def shared(cls, log_path: str | Path, *, preload_model: str | None = None) -> Zygote | None:
        """A sub-zygote of the shared zygote that ROLLFLEET_ZYGOTE_SOCKET names, or None (no variable,
        or nothing listens there: then `log_path` says so, and the caller starts or spawns its own)."""
        path = os.environ.get(SHARED_ZYGOTE_ENV)
        if not path:
            return None
        try:
            return cls.connect(path, log_path, preload_model=preload_model)
        except OSError as err:
            Path(log_path).parent.mkdir(parents=True, exist_ok=True)
            Path(log_path).write_text(f"no shared zygote at {path} ({err}): not forking from it\n")
            return None

    def _begin(self, answers, requests) -> None:
        """Follow the zygote's answers (a pipe or a socket) on a thread of their own."""
        self._requests = requests
        self.ready = threading.Event()  # set when it said ready, or when it is gone
        self._gone = False  # its stdout closed: it exited
        self.info: dict = {}  # the zygote's ready line: imports_s, threads, pid
        self._answers: list[dict] = []
        self._exit_codes: dict[int, int] = {}
        self._changed = threading.Condition()
        self._request_lock = threading.Lock()  # one fork request at a time: answers come in order
        threading.Thread(target=self._read, args=(answers,), name="zygote-reader", daemon=True).start()

    @property
    def pid(self) -> int | None:
        """The zygote that forks our engines (a sub-zygote's once it said ready)."""
        return self.proc.pid if self.proc is not None else self.info.get("pid")

    def _read(self, answers) -> None:
        for line in answers:
            message = json.loads(line)
            with self._changed:
                if "ready" in message:
                    self.info = message
                    self.ready.set()
                elif "exited" in message:
                    self._exit_codes[message["exited"]] = message["code"]
                else:
                    self._answers.append(message)
                self._changed.notify_all()
        with self._changed:  # EOF: the zygote is gone; wake every waiter
            self._gone = True
            self.ready.set()
            self._changed.notify_all()

    def is_alive(self) -> bool:
        return not self._gone and (self.proc is None or self.proc.poll() is None)

    def fork(self, argv: list[str], env: dict[str, str], log_path: str | Path, timeout: float) -> ForkedProcess:
        """Fork an embedded engine server (`argv` as for a spawn: python -m rollfleet.engine.process.server ...)."""
        if argv[1:3] != ENGINE_MODULE:
            raise ZygoteGone(f"the zygote starts only the embedded engine, not {' '.join(argv[1:3])}")
        if not self.ready.wait(timeout) or not self.is_alive() or not self.info:
            raise ZygoteGone(self._why_not_ready())
        request = {"argv": argv[3:], "env": env, "log": str(log_path)}
        with self._request_lock:
            self._requests.write((json.dumps(request) + "\n").encode())
            self._requests.flush()
            answer = self._next_answer(timeout)
        if "pid" not in answer:
            raise ZygoteGone(f"the zygote refused: {answer.get('error')}")
        return ForkedProcess(answer["pid"], self)

    def _why_not_ready(self) -> str:
        if self.is_alive():
            return "the zygote is not ready yet (still importing)"
        if self.proc is None:
            return "the shared zygote's sub-zygote closed its connection"
        return f"the zygote exited (code {self.proc.poll()}; its log: {self.log_path})"

    def _next_answer(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        with self._changed:
            while not self._answers:
                if not self.is_alive() or not self._changed.wait(max(0.0, deadline - time.monotonic())):
                    if not self._answers:
                        raise ZygoteGone(self._why_not_ready() if not self.is_alive() else "the zygote did not answer")
            return self._answers.pop(0)

    def exit_code(self, pid: int, timeout: float) -> int:
        """How child `pid` ended, once the zygote reaped it (it reaps every 50 ms)."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while pid not in self._exit_codes and self.is_alive() and time.monotonic() < deadline:
                self._changed.wait(0.05)
            return self._exit_codes.get(pid, UNKNOWN_EXIT_CODE)

    def close(self) -> None:
        """Let the zygote go (stdin closes; its children run on) and wait for it."""
        if self.proc is None:  # a sub-zygote: it ends when its connection closes
            self._sock.shutdown(socket.SHUT_RDWR)  # closes it for the reader thread's file too
            self._sock.close()
            return
        if self.proc.stdin and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class ForkedProcess:
    """`subprocess.Popen`'s answers for an engine the zygote forked."""

    def __init__(self, pid: int, zygote: Zygote):
        self.pid, self._zygote = pid, zygote
        self.returncode: int | None = None
        try:
            self._pidfd: int | None = os.pidfd_open(pid)
        except ProcessLookupError:  # ended (and was reaped) already
            self._pidfd = None

    def poll(self) -> int | None:
        return self.returncode if self._ended(0.0) else None

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended(timeout):
            raise subprocess.TimeoutExpired(f"engine pid {self.pid}", timeout)
        return self.returncode

    def _ended(self, timeout: float | None) -> bool:
        """Threads may ask at once (a blocking wait beside polls): an ended process's pidfd stays
        readable, so it stays open until this object goes."""
        if self.returncode is not None:
            return True
        if self._pidfd is not None:
            readable, _, _ = select.select([self._pidfd], [], [], timeout)
            if not readable:
                return False
        self.returncode = self._zygote.exit_code(self.pid, timeout=2.0)
        return True

    def __del__(self) -> None:
        if getattr(self, "_pidfd", None) is not None:
            os.close(self._pidfd)
