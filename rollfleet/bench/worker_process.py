"""A benchmark's worker in a process group of its own (it may start an engine server, which it stops
on its way out): run to its end or a time limit, and stopped with the benchmark when the benchmark is
stopped from outside (a shell's `timeout` sends SIGTERM), saying where it got to.

    stop_on_sigterm()                       # once, in the benchmark's main
    code = run_worker_process(name, command, log, timeout_s)   # None: stopped at the limit
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

_starting = False  # a worker is being started: SIGTERM waits until its Popen exists
_stop_asked = False


def stop_on_sigterm() -> None:
    """SIGTERM ends the benchmark through its `finally`s (SystemExit 143), which stop its worker. Held
    back while a worker starts: raised inside `Popen`, it would lose a worker nothing could stop."""

    def on_sigterm(*_) -> None:
        global _stop_asked
        if _starting:
            _stop_asked = True
        else:
            sys.exit(143)

    signal.signal(signal.SIGTERM, on_sigterm)


def run_worker_process(name: str, command: list[str], log: Path, timeout_s: float) -> int | None:
    """`command`'s exit code, its output in `log`; None when it ran past `timeout_s` (then stopped, and
    the end of its log and of its engine server's printed). A benchmark stopped meanwhile stops it."""
    global _starting
    with open(log, "w") as handle:
        _starting = True
        try:
            proc = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            _starting = False
        try:
            if _stop_asked:
                sys.exit(143)
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            stop(proc)
            print_tails(name, log)
            return None
        finally:  # the benchmark itself stopped (SIGTERM, Ctrl-C): its worker goes with it
            if proc.poll() is None:
                stop(proc, grace=15)
                print_tails(name, log)


def print_tails(name: str, log: Path) -> None:
    """The end of a stopped worker's log and of its engine server's (`<log stem>.engine.log`)."""
    for path in (log, log.with_suffix(".engine.log")):
        if path.exists():
            print(f"  {name}: stopped; the end of {path.name}:\n{path.read_text(errors='replace')[-1500:]}", flush=True)


def stop(proc: subprocess.Popen, grace: float = 60) -> int:
    """SIGTERM to the worker's group (the worker stops its engine server on the way out), SIGKILL
    `grace` s later."""
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        return proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.wait()
