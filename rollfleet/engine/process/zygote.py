"""A pre-imported engine launcher (a "zygote"): engine restarts without paying Python's imports.

`python -m rollfleet.engine.process.zygote [--preload-model DIR]` imports torch, transformers and the
embedded engine's modules once (and the model's code), touches no device, opens no socket and
starts no thread; then, for each request read from its stdin, it forks an engine server. The child
makes a session of its own (a stop kills its process group: the engine and its tp followers),
writes to its own log file, takes the request's environment (CUDA_VISIBLE_DEVICES included: CUDA
is first touched after the fork) and runs `rollfleet.engine.process.server.main` with the request's argv.
Imports measured on GPU were 5-8 s of a 8-12 s restart; a forked start reports `imports` ~0 and
`launch: zygote` in its start breakdown (start_timing.py).

Fork safety: a fork copies only the calling thread, so a lock held by another thread stays locked
in the child forever. The zygote checks after its imports that it is the only thread (OpenBLAS, which
numpy loads, starts a pool unless OPENBLAS_NUM_THREADS=1, which the launcher sets) and refuses to
fork otherwise; `torch.cuda.is_available` uses NVML (PYTORCH_NVML_BASED_CUDA_CHECK), which leaves
CUDA uninitialised and a fork safe.

Protocol, one JSON line each way: the zygote says `{"ready": true, "imports_s": s}` once, then
answers each `{"argv": [...], "env": {...}, "log": path}` with `{"pid": P}` or `{"error": why}`, and
writes `{"exited": P, "code": C}` when it reaps a child (no zombie is left behind). It exits when
its stdin closes: its worker died or let it go. Children outlive it, like spawned engines.

Shared: with `--listen SOCKET` it also accepts connections on that Unix socket, and for each forks
a sub-zygote (its imports already done) that serves the connection as a zygote serves its stdin:
the client sends `{"preload_model": DIR or null}` first, the sub-zygote says ready, then forks
engines on request. Several launchers of one host (the engine workers of successive fleets, e.g.
a test run's) then pay the imports once; `ROLLFLEET_ZYGOTE_SOCKET` tells them where it listens.
"""

from __future__ import annotations

import os

os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # before torch: is_available() stays fork-safe

# isort: split
import argparse
import contextlib
import json
import select
import signal
import socket
import sys
import time
import traceback

from rollfleet.engine.process.start_timing import FORKED_AT_ENV

REAP_EVERY_S = 0.05


def preload(model_path: str | None) -> None:
    """Everything an engine start would import, so that a forked child imports nothing."""
    import rollfleet.engine.http.app  # noqa: F401
    import rollfleet.engine.http.remote_pull  # noqa: F401
    import rollfleet.engine.http.service  # noqa: F401
    import rollfleet.engine.process.server  # noqa: F401  (torch, transformers, the model runner)
    import rollfleet.engine.runtime.scheduler  # noqa: F401

    if model_path:
        from rollfleet.engine.model.build import model_class

        model_class(model_path)  # the model's code (transformers' modeling module, torch._dynamo)


def threads() -> list[str]:
    """Every thread of this process, by its kernel name: one (this one) before a fork is safe."""
    tasks = sorted(os.listdir("/proc/self/task"))
    return [open(f"/proc/self/task/{t}/comm").read().strip() for t in tasks]


def _say(message: dict) -> None:
    os.write(1, (json.dumps(message) + "\n").encode())  # unbuffered: nothing is left to a child's copy


def _child(request: dict) -> None:
    """In the forked child: become the engine server. Never returns."""
    code = 1
    try:
        os.setsid()
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.close(devnull)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.environ.clear()
        os.environ.update(request["env"])
        os.environ[FORKED_AT_ENV] = repr(time.time())
        os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # its tp followers fork from it too
        _threads_from_env()
        from rollfleet.engine.process import server

        sys.argv = ["rollfleet.engine.process.server", *request["argv"]]
        code = 0
        server.main(request["argv"])
    except SystemExit as stop:  # argparse errors and a normal exit
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _threads_from_env() -> None:
    """torch read OMP_NUM_THREADS when the zygote imported it, from the zygote's environment: a
    request's own value (Ray gives its workers 1) is applied here, as a spawned engine would read it."""
    value = os.environ.get("OMP_NUM_THREADS", "")
    if value.isdigit() and int(value) > 0:
        import torch

        torch.set_num_threads(int(value))


def _fork(request: dict) -> dict:
    extra = threads()[1:]
    if extra:
        return {"error": f"the zygote has threads besides its own ({extra}): a fork would not be safe"}
    if not {"argv", "env", "log"} <= set(request):
        return {"error": f"a request needs argv, env and log; got {sorted(request)}"}
    pid = os.fork()
    if pid == 0:
        _child(request)
    return {"pid": pid}


def _reap() -> None:
    """Collect every child that ended (none stays a zombie) and say how it ended."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _say({"exited": pid, "code": os.waitstatus_to_exitcode(status)})


def serve(listener: socket.socket | None = None) -> None:
    """Fork on request until stdin closes; with a listener, a sub-zygote for each connection."""
    pending = b""
    watched = [0] if listener is None else [0, listener]
    while True:
        readable, _, _ = select.select(watched, [], [], REAP_EVERY_S)
        _reap()
        if listener is not None and listener in readable:
            _serve_connection(*listener.accept(), listener)
        if 0 not in readable:
            continue
        chunk = os.read(0, 65536)
        if not chunk:
            return  # the worker is gone or let go: the children run on, in their own sessions
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            try:
                _say(_fork(json.loads(line)))
            except (ValueError, OSError) as err:
                _say({"error": f"{type(err).__name__}: {err}"})


def _serve_connection(conn: socket.socket, _address, listener: socket.socket) -> None:
    """Fork a sub-zygote that serves `conn` as its stdin and stdout (the parent keeps no copy of it,
    so the client sees EOF when the sub-zygote ends); it reaps, and answers for, its own children."""
    if threads()[1:]:  # a fork would not be safe: the client sees EOF and spawns instead
        conn.close()
        return
    pid = os.fork()
    if pid != 0:
        conn.close()
        return
    code = 1
    try:
        listener.close()
        os.dup2(conn.fileno(), 0)
        os.dup2(conn.fileno(), 1)
        conn.close()
        hello = b""
        while not hello.endswith(b"\n"):  # the client's first line: the model whose code to import
            chunk = os.read(0, 4096)
            if not chunk:
                os._exit(0)
            hello += chunk
        preload(json.loads(hello).get("preload_model"))
        _say({"ready": True, "imports_s": 0.0, "threads": threads(), "pid": os.getpid()})
        serve()
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(code)


def _listener(path: str) -> socket.socket:
    """A Unix socket at `path` (a stale one from a zygote that died is replaced)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    return listener


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m rollfleet.engine.process.zygote")
    parser.add_argument("--preload-model", default=None, help="also import this model's code")
    parser.add_argument("--listen", default=None, help="also serve launchers that connect to this Unix socket")
    args = parser.parse_args()
    started = time.time()
    # listening before the imports: a launcher that connects meanwhile waits for its ready line
    listener = _listener(args.listen) if args.listen else None
    preload(args.preload_model)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C in the terminal is for the worker to handle
    _say({"ready": True, "imports_s": round(time.time() - started, 3), "threads": threads(), "pid": os.getpid()})
    serve(listener)


if __name__ == "__main__":
    main()
