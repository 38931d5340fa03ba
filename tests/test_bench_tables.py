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

import pytest

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


def _weight_sync(tmp_path: Path, *extra: str) -> tuple[subprocess.CompletedProcess, dict]:
    record = tmp_path / "record.json"
    args = ["--transport", "nccl", "--size-gb", "0.002", "--device", "cpu", "--repeats", "2", "--json", str(record)]
    out = _run("-m", "rollfleet", "bench", "weight-sync", *args, *extra)
    assert record.exists(), out.stdout[-2000:] + out.stderr[-2000:]
    return out, json.loads(record.read_text())


def test_weight_sync_benchmark_writes_a_complete_record(tmp_path):
    out, record = _weight_sync(tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert RECORD_KEYS <= set(record) and record["ok"] is True and record["benchmark"] == "weight-sync"
    assert record["command"].startswith("rollfleet bench weight-sync --transport nccl")
    assert record["config"]["repeats"] == 2 and len(record["repeats"]) == 2
    for row in record["repeats"]:
        assert row["verified"] and row["raw_s"] > 0 and row["sync_s"] > 0 and row["verify_s"] > 0
    summary = record["summary"]
    assert summary["raw_s"]["n"] == summary["sync_s"]["n"] == 2  # the ceiling repeated as often as the sync
    assert summary["raw_s"]["min"] <= summary["raw_s"]["median"] <= summary["raw_s"]["max"]
    assert summary["ratio_sync_to_raw"] > 0 and summary["old_method"]["ratio_sync_to_raw"] > 0
    assert "ratio sync / raw" in out.stdout


def test_weight_sync_benchmark_refuses_figures_when_verification_fails(tmp_path):
    out, record = _weight_sync(tmp_path, "--tamper-for-test")
    assert out.returncode != 0
    assert "ratio" not in out.stdout.lower() and "verification FAILED" in out.stderr
    assert record["ok"] is False and record["summary"]["verified"] is False
    assert "ratio_sync_to_raw" not in record["summary"] and "tensors differing" in record["failure"]
