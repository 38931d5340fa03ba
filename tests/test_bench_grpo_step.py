"""`rollfleet bench grpo-step` on CPU with a tiny shape: a LoRA run starts under it (no bucket size
asked of the lora transport), and its record keeps every run's figures and memory plan."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest

from rollfleet.bench.grpo_step import STEPS, bucket_overrides, main, parse
from rollfleet.bench.record import run_echoing
from rollfleet.config import load_config


def test_buckets_are_asked_only_of_transports_that_take_them():
    assert bucket_overrides(["weight_sync.transport=tensor"]) == ["weight_sync.bucket_mb=2048"]
    assert bucket_overrides(["weight_sync.transport=nccl"]) == ["weight_sync.bucket_mb=2048"]
    assert bucket_overrides(["weight_sync.transport=tensor", "weight_sync.transport=lora"]) == []
    assert bucket_overrides(["weight_sync.transport=disk"]) == []


def test_the_large_step_is_64_x_8_x_512_at_the_one_gpu_examples_micro_batch():
    """At 32 rows the trainer's turn needs 98 GB, which an 80 GB GPU's plan refuses (2026-12-06, H100)."""
    large = parse(["--step", "large"])
    example = load_config("examples/gpu-1x.yaml").train.micro_batch_size
    assert (large.prompts, large.n, large.new_tokens, STEPS["large"][3]) == (64, 8, 512, example) == (64, 8, 512, 16)
    small = parse(["--new-tokens", "4"])
    assert (small.prompts, small.n, small.new_tokens) == (16, 8, 4)


def test_a_colocated_lora_run_of_the_bench_passes_on_cpu(tmp_path):
    out, record_path = tmp_path / "work", tmp_path / "record.json"
    tiny = ["--hidden", "64", "--layers", "2", "--vocab", "320", "--prompts", "2", "--n", "2", "--new-tokens", "3"]
    lora = [
        "--set=weight_sync.transport=lora",
        f"--set=weight_sync.path={tmp_path / 'adapters'}",
        "--set=train.lora.target_modules=[q_proj,v_proj]",
    ]
    main(
        ["--runs", "colocated", "--gpus", "1", "--steps", "2", "--skip", "1", "--repeats", "1", *tiny, *lora]
        + ["--config", "examples/cpu-demo-lora.yaml", "--out", str(out), "--json", str(record_path)]
    )
    record = json.loads(record_path.read_text())
    run = record["repeats"][0]
    assert record["ok"] and run["exit_code"] == 0 and len(run["rows"]) == 2
    assert "bucket_mb" not in run["command"] and "weight_sync.transport=lora" in run["command"]
    assert run["memory_plan"] is None  # a CPU run shares no GPU: nothing is planned
    assert record["summary"]["phases"]["colocated"]["steps"] == 1


def test_a_runs_plan_and_step_lines_are_printed_as_they_come_and_a_silent_run_is_killed(capsys):
    log = io.StringIO()
    lines = ["memory plan of each GPU: {}", "noise", "step    1/2  reward 0.1"]
    child = "".join(f"print({line!r}); " for line in lines) + "raise SystemExit(3)"
    assert run_echoing([sys.executable, "-c", child], log, 120, prefix="colocated: ") == 3
    assert capsys.readouterr().out.splitlines() == ["colocated: " + lines[0], "colocated: " + lines[2]]
    assert log.getvalue().splitlines() == lines
    with pytest.raises(subprocess.TimeoutExpired):  # prints nothing, never ends: killed at its limit
        run_echoing([sys.executable, "-c", "import threading; threading.Event().wait()"], io.StringIO(), 0.5)
