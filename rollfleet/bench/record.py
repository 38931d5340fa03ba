"""The record every benchmark writes next to its printed figures: enough to say which code, on which
machine, with which command and configuration produced them, and every repeat behind the summary.

    write_record(path, "weight-sync", argv, config, repeats, summary, ok=True)

Nothing here names a path of the machine that ran it: the hostname is hashed, the command is given
as `rollfleet bench NAME ARGS` (or the script's name and arguments) with the repository root replaced by `.`.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

SCHEMA = 1
REPO = Path(__file__).resolve().parents[2]
RESULTS_DIR = "docs/results"  # committed results; writing them must not mark the tree dirty


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def code_revision() -> dict[str, Any]:
    """The commit checked out and whether tracked files (outside docs/results) differ from it. A copy
    without git history (e.g. a working tree shipped to a GPU machine) takes both from the environment:
    ROLLFLEET_GIT_REVISION and ROLLFLEET_GIT_DIRTY (0 or 1), set by whoever shipped it. When set, they
    win over git: a shipped copy may carry a .git that is not the commit it holds."""
    revision = None if os.environ.get("ROLLFLEET_GIT_REVISION") else _git("rev-parse", "HEAD")
    if revision is None:
        dirty = os.environ.get("ROLLFLEET_GIT_DIRTY")
        return {
            "revision": os.environ.get("ROLLFLEET_GIT_REVISION"),
            "dirty": None if dirty is None else dirty == "1",
            "from": "environment",
        }
    status = _git("status", "--porcelain", "--untracked-files=no", "--", ".", f":!{RESULTS_DIR}")
    return {"revision": revision, "dirty": None if status is None else bool(status), "from": "git"}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _load() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def start() -> dict[str, Any]:
    """What a record must capture before the benchmark runs: the code it runs and the machine's load."""
    return {"code": code_revision(), "load_avg_at_start": _load(), "started_utc": _now()}


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def machine() -> dict[str, Any]:
    """The machine, without naming it: hostname hashed, CPU model, GPUs, library versions, and the
    load average (1, 5, 15 min) when the record is written (a shared machine's figures depend on it)."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    gpus = [torch.cuda.get_device_name(i) for i in range(count)]
    return {
        "host_sha256_12": hashlib.sha256(socket.gethostname().encode()).hexdigest()[:12],
        "platform": platform.platform(terse=True),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "gpus": gpus,
        "cuda": torch.version.cuda if gpus else None,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "load_avg_at_end": _load(),
    }


def command_line(prefix: list[str], argv: list[str] | None) -> str:
    """`prefix ARGS` as run (argv as parsed, or the process's own), the repository root written as `.`."""
    args = list(sys.argv[1:] if argv is None else argv)
    text = " ".join([*prefix, *args])
    text = text.replace(str(REPO) + "/", "./").replace(str(REPO), ".")
    out = os.environ.get("OUT")  # the GPU scripts' output folder, a path of that machine
    text = text.replace(out.rstrip("/") + "/", "$OUT/") if out and len(out) > 1 else text
    scratch = tempfile.gettempdir()  # a log folder under it (--log-dir /tmp/...): also that machine's
    return text.replace(scratch.rstrip("/") + "/", "$TMPDIR/") if len(scratch) > 1 else text


def _clean(value: Any) -> Any:
    if isinstance(value, float):
        return round(value, 6)
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value


def make_record(
    name: str,
    command: str,
    config: dict[str, Any],
    repeats: list[dict[str, Any]],
    summary: dict[str, Any],
    ok: bool,
    failure: str | None = None,
    started: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """`started`: start()'s answer, taken before the benchmark ran (else the code is read now)."""
    started = started or {"code": code_revision(), "load_avg_at_start": None, "started_utc": None}
    return _clean(
        {
            "schema": SCHEMA,
            "benchmark": name,
            "date_utc": _now(),
            "started_utc": started["started_utc"],
            "ok": ok,
            "failure": failure,
            "code": started["code"],
            "machine": {**machine(), "load_avg_at_start": started["load_avg_at_start"]},
            "command": command,
            "config": config,
            "repeats": repeats,
            "summary": summary,
        }
    )


def write_record(path: str | Path | None, record: dict[str, Any]) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(record, indent=1) + "\n")


def spread(values: list[float]) -> dict[str, float]:
    """min / median / max of a list of figures (seconds or GB/s)."""
    import statistics

    return {"min": min(values), "median": statistics.median(values), "max": max(values), "n": len(values)}


ECHOED = ("memory plan", "step ", "Traceback")  # a run's lines `run_echoing` prints as they come


def run_echoing(command: list[str], handle, timeout_s: float, prefix: str = "") -> int:
    """Run `command` with its output into `handle`, printing its memory plan, step and error lines as
    they come (a bench cut by an outer time limit still shows how far its run got); its exit code.
    Past `timeout_s` the run is killed and subprocess.TimeoutExpired raised, as subprocess.call does."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    killed = threading.Event()

    def kill():  # on a timer: a silent run is killed too
        killed.set()
        process.kill()

    timer = threading.Timer(timeout_s, kill)
    timer.start()
    try:
        for line in process.stdout:
            handle.write(line)
            if line.lstrip().startswith(ECHOED) or "Error:" in line:
                print(prefix + line.rstrip()[:400], flush=True)
        code = process.wait()
    finally:
        timer.cancel()
    if killed.is_set():
        raise subprocess.TimeoutExpired(command, timeout_s)
    return code
