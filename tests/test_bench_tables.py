"""Benchmark records and the tables made from them.

The tables in docs/benchmarks.md and README.md are generated from docs/results/*.json by
scripts/make_tables.py; these tests fail when a table was edited by hand or a record changed
without regenerating, and run the weight-sync benchmark end to end at a tiny CPU size (an honest
run, then one whose verification is forced to fail)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from subprocess import PIPE

import pytest
from conftest import shared_zygote

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "docs" / "results"
RECORD_KEYS = {"schema", "benchmark", "date_utc", "ok", "failure", "code", "machine", "command", "config", "repeats"}


def _run(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)


def test_committed_tables_are_generated_from_committed_records():
    out = _run("scripts/make_tables.py", "--check")
    assert out.returncode == 0, out.stdout + out.stderr + "\nrun: python scripts/make_tables.py"


@pytest.mark.parametrize("path", sorted(RESULTS.glob("*.json")), ids=lambda p: p.name)
def test_committed_records_are_complete_and_name_no_local_path(path):
    text = path.read_text()
    record = json.loads(text)
    assert RECORD_KEYS | {"summary"} <= set(record)
    assert record["code"]["revision"] and record["code"]["dirty"] is False, "commit the code before measuring"
    assert record["ok"] is True and record["repeats"]
    assert {"host_sha256_12", "cpu", "gpus", "torch"} <= set(record["machine"])
    for local in {str(REPO), tempfile.gettempdir(), str(Path.home())}:
        assert local not in text, f"{path.name} names a local path ({local})"


def test_bench_modules_stay_small():
    for module in (REPO / "rollfleet" / "bench").glob("*.py"):
        source = module.read_text()
        assert source.count("\n") <= 400, module.name
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                assert node.end_lineno - node.lineno + 1 <= 60, f"{module.name}:{node.name} is over 60 lines"


@pytest.fixture(scope="module")
def weight_sync_runs(tmp_path_factory) -> dict[str, tuple[subprocess.CompletedProcess, dict]]:
    """The weight-sync benchmark run twice at a tiny CPU size, honest and with its verification forced
    to fail: both at once (each mostly waits on its own engine and imports), by run name."""
    args = ["--transport", "nccl", "--size-gb", "0.002", "--vocab", "320", "--device", "cpu", "--repeats", "2"]
    shared_zygote()  # listening: the benchmarks' engines fork from it (ROLLFLEET_ZYGOTE_SOCKET), no imports
    runs = {}
    for name, extra in (("honest", []), ("tampered", ["--tamper-for-test"])):
        record = tmp_path_factory.mktemp(name) / "record.json"
        command = [sys.executable, "-m", "rollfleet", "bench", "weight-sync", *args, "--json", str(record), *extra]
        runs[name] = (subprocess.Popen(command, cwd=REPO, stdout=PIPE, stderr=PIPE, text=True), record)
    answers = {}
    try:
        for name, (proc, record) in runs.items():
            stdout, stderr = proc.communicate(timeout=300)
            out = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
            assert record.exists(), stdout[-2000:] + stderr[-2000:]
            answers[name] = (out, json.loads(record.read_text()))
    finally:
        for proc, _ in runs.values():
            if proc.poll() is None:  # the other run, when one failed
                proc.kill()
    return answers


def test_weight_sync_benchmark_writes_a_complete_record(weight_sync_runs):
    out, record = weight_sync_runs["honest"]
    assert out.returncode == 0, out.stderr[-2000:]
    assert RECORD_KEYS <= set(record) and record["ok"] is True and record["benchmark"] == "weight-sync"
    assert record["command"].startswith("rollfleet bench weight-sync --transport nccl")
    assert record["config"]["repeats"] == 2 and len(record["repeats"]) == 2
    assert all(row["verified"] for row in record["repeats"])
    summary = record["summary"]
    assert summary["raw_s"]["n"] == summary["sync_s"]["n"] == 2  # the ceiling repeated as often as the sync
    for key in ("raw_s", "sync_s"):  # the summary is of the repeats it sits beside (durations > 0 could not fail)
        values = [row[key] for row in record["repeats"]]
        assert (summary[key]["min"], summary[key]["max"]) == (min(values), max(values)), (key, summary[key], values)
    assert "ratio sync / raw" in out.stdout


def test_weight_sync_benchmark_refuses_figures_when_verification_fails(weight_sync_runs):
    out, record = weight_sync_runs["tampered"]
    assert out.returncode != 0
    assert "ratio" not in out.stdout.lower() and "verification FAILED" in out.stderr
    assert record["ok"] is False and record["summary"]["verified"] is False
    assert "ratio_sync_to_raw" not in record["summary"] and "tensors differing" in record["failure"]


def test_a_records_command_names_no_path_of_the_machine(monkeypatch):
    """The repository, the GPU scripts' $OUT and the temporary folder (a --log-dir under /tmp) are
    written as placeholders: a record committed from another machine passes the check above."""
    from rollfleet.bench.record import command_line

    scratch = tempfile.gettempdir()
    monkeypatch.setenv("OUT", f"{scratch}/round-7")
    argv = ["--log-dir", f"{scratch}/rf-work/logs", "--json", f"{scratch}/round-7/a.json", "--model", f"{REPO}/m"]
    text = command_line(["rollfleet", "bench", "weight-sync"], argv)
    assert text == "rollfleet bench weight-sync --log-dir $TMPDIR/rf-work/logs --json $OUT/a.json --model ./m"
