"""`rollfleet bench generate` end to end on CPU at a tiny shape (the embedded engine over HTTP and the
transformers generate baseline, each in its own process), its record, and the table made from it;
the word-level tokenizer the GPU benchmarks use."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import shared_zygote
from waits import wait_until

from rollfleet.bench.generate import case_summary, parse_cases
from rollfleet.bench.roofline import roofline
from rollfleet.tiny_models import make_word_tokenizer

REPO = Path(__file__).resolve().parent.parent
RECORD_KEYS = {"schema", "benchmark", "ok", "failure", "code", "machine", "command", "config", "repeats", "summary"}


def _make_tables():
    spec = importlib.util.spec_from_file_location("make_tables", REPO / "scripts" / "make_tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def generate_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, dict]:
    record = tmp_path_factory.mktemp("generate") / "generate-cpu.json"
    shared_zygote()  # the embedded engine forks from it (ROLLFLEET_ZYGOTE_SOCKET): no imports to pay
    args = ["--device", "cpu", "--hidden", "64", "--layers", "2", "--vocab", "2000", "--cases", "2x2x8"]
    args += [
        "--engines",
        "embedded,embedded_batch,generate",
        "--repeats",
        "2",
        "--timeout-s",
        "120",
        "--engine-flags",
        "--rollfleet-arrival-wait-ms 0",  # passed to the embedded engines: they never hold a wave back
        "--json",
        str(record),
    ]
    command = [sys.executable, "-m", "rollfleet", "bench", "generate", *args]
    out = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert record.exists(), out.stdout[-3000:] + out.stderr[-3000:]
    return out, json.loads(record.read_text())


def test_generate_benchmark_writes_a_complete_record(generate_run):
    out, record = generate_run
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert RECORD_KEYS <= set(record) and record["ok"] is True and record["benchmark"] == "generate"
    assert record["command"].startswith("rollfleet bench generate --device cpu")
    assert record["config"]["vocab"] == 2000 and record["config"]["engines"] == "embedded,embedded_batch,generate"
    # every pass of every engine produced prompts x n x new tokens (a baseline that stopped early fails)
    assert sorted((r["engine"], r["pass"]) for r in record["repeats"]) == [
        ("embedded", 1),
        ("embedded", 2),
        ("embedded_batch", 1),
        ("embedded_batch", 2),
        ("generate", 1),
        ("generate", 2),
    ]
    assert all(r["tokens"] == 2 * 2 * 8 and r["rows"] == 4 and r["seconds"] > 0 for r in record["repeats"])
    embedded = [r for r in record["repeats"] if r["engine"].startswith("embedded")]
    assert all(r["logprobs"] == r["tokens"] for r in embedded)  # return_logprob: one per output token
    case = record["summary"]["cases"]["2x2x8"]
    assert case["expected_tokens"] == 32 and set(case["engines"]) == {"embedded", "embedded_batch", "generate"}
    assert case["roofline"]["steps"] == 8 and case["roofline"]["tok_s"] > 0
    assert case["ratios"]["embedded/generate"] > 0 and "embedded/generate_batch" not in case["ratios"]
    assert case["ratios"]["embedded/embedded_batch"] > 0  # the per-request path against one request
    assert record["summary"]["copy_gb_per_s"]["median"] > 0 and not record["summary"]["failed_runs"]
    assert "| 2x2x8 | embedded |" in out.stdout and "rf-bench-generate" not in json.dumps(record)
    # the 2 prompts' 2 samples share one prefill each (the bench's prompts: 64 tokens); 8 new tokens
    # are the first one sampled by the prefill step and 7 decode steps at least
    steps = case["engines"]["embedded"]
    assert steps["prefill_of_prompts"] == 1.0 and steps["decode_steps"] >= 7 and steps["prefill_steps"] >= 1
    # on a CPU the host is the device: no step's draws are ever waited for (a GPU's are, draws.py)
    assert steps["device_waits"] == 0 and steps["device_wait_seconds"] == 0
    assert "the host waited for the device at 0 steps (0.00 s)" in out.stdout
    # the pass's time outside the steps: what is left of it beside the steps' own seconds
    pass_s = case["engines"]["embedded"]["seconds"]["median"]
    assert 0 < steps["outside_steps_s"] < pass_s and 0 < steps["outside_steps_share"] < 1
    assert "of the pass)" in out.stdout
    # and where it went, by the engine's clock (passes of one batch): before, between, after the steps
    for one in (r for r in record["repeats"] if "clock" in r.get("scheduler", {})):
        clock, scheduler = one["scheduler"]["clock"], one["scheduler"]
        outside = one["seconds"] - scheduler["prefill_seconds"] - scheduler["decode_seconds"]
        parts = ("before_steps_s", "between_steps_s", "answering_s", "delivery_s")
        assert sum(clock[key] for key in parts) == pytest.approx(outside, abs=2e-3)
        assert all(clock[key] >= 0 for key in parts if key != "between_steps_s")
        assert 0 <= clock["of_which_retire_s"] + clock["of_which_texts_s"] <= clock["answering_s"]
        assert "before steps" in out.stdout and "delivery" in out.stdout
    assert "| 2x2x8 | embedded steps | prefill 1.00 x the prompts' tokens;" in out.stdout
    # --engine-flags reached the engines: with --rollfleet-arrival-wait-ms 0 no pass held its arrivals
    assert record["config"]["engine_flags"] == "--rollfleet-arrival-wait-ms 0"
    assert [r["scheduler"]["arrival_holds"] for r in embedded if r["engine"] == "embedded"] == [0, 0]


def test_generate_table_renders_from_the_record(generate_run):
    _, record = generate_run
    text = _make_tables().generate([("generate-cpu.json", record)])
    assert "vocab 2,000" in text and "`generate-cpu.json`" in text
    row = next(line for line in text.splitlines() if line.startswith("| 2x2x8 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert len(cells) == 14 and cells[5] == "-"  # generate_batch was not asked for
    ratios = record["summary"]["cases"]["2x2x8"]["ratios"]
    assert float(cells[7].strip("*")) == pytest.approx(ratios["embedded/embedded_batch"], abs=0.01)
    assert float(cells[8].strip("*")) == pytest.approx(ratios["embedded/generate"], abs=0.01)


def test_a_stopped_bench_stops_its_worker_and_says_where_it_got_to(tmp_path):
    """A shell's `timeout` stops the bench with SIGTERM: its worker (a process group of its own, which
    holds an engine server) goes with it, and the end of the worker's log is printed."""
    shared_zygote()
    args = ["--device", "cpu", "--hidden", "64", "--layers", "2", "--vocab", "2000", "--cases", "2x2x8"]
    args += ["--engines", "embedded", "--repeats", "1", "--timeout-s", "120"]
    command = [sys.executable, "-m", "rollfleet", "bench", "generate", *args]
    bench = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in bench.stdout:  # the worker of the case has started (the copy's came and went before)
        lines.append(line)
        if "embedded-2x2x8 ..." in line:
            break
    children = wait_until(
        lambda: Path(f"/proc/{bench.pid}/task/{bench.pid}/children").read_text().split(),
        what="the case's worker process",
        alive=lambda: bench.poll() is None,
    )
    assert len(children) == 1, lines
    bench.terminate()  # maybe while the worker is still being started: it is stopped all the same
    rest, _ = bench.communicate(timeout=120)
    assert bench.returncode == 143 and "embedded-2x2x8: stopped; the end of embedded-2x2x8.log" in rest, rest
    with pytest.raises(ProcessLookupError):  # the worker's group: nothing of it left
        os.killpg(int(children[0]), 0)


def test_a_pass_with_fewer_tokens_than_asked_is_a_problem():
    case = parse_cases("2x2x8")[0]
    limit = roofline(case, 64, {"weights_read_per_step_bytes": 10**6, "kv_bytes_per_token": 512}, 10.0)
    answers = {
        "embedded": {"passes": [{"seconds": 1.0, "tokens": 32}]},
        "generate": {"passes": [{"seconds": 1.0, "tokens": 32}, {"seconds": 1.0, "tokens": 20}]},
    }
    summary = case_summary(case, answers, limit)
    assert summary["problems"] == ["generate 2x2x8: [20] output tokens, expected 32"]
    assert summary["engines"]["embedded"]["tokens_ok"] and not summary["engines"]["generate"]["tokens_ok"]


def test_roofline_sums_weights_and_live_kv_over_the_steps():
    limit = roofline((2, 3, 4), 10, {"weights_read_per_step_bytes": 1000, "kv_bytes_per_token": 8}, 1e-6)
    rows, live = 6, sum(10 + t for t in range(4))
    assert limit["bytes"] == 4 * 1000 + rows * live * 8 and limit["seconds"] == pytest.approx(limit["bytes"] / 1e3)


def test_cases_are_checked():
    assert parse_cases("64x8x256, 1x1x256") == [(64, 8, 256), (1, 1, 256)]
    with pytest.raises(SystemExit, match="PROMPTSxNxNEW_TOKENS"):
        parse_cases("64x8")


def test_word_tokenizer_has_exactly_the_asked_size(tmp_path):
    from transformers import AutoTokenizer

    make_word_tokenizer(151_936).save_pretrained(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    assert len(tokenizer) == 151_936 and tokenizer.eos_token_id == tokenizer.pad_token_id == 0
    assert tokenizer.encode("w16 w151935") == [16, 151_935] and tokenizer.decode([16, 17]) == "w16 w17"
    # the copy task's prompt is known tokens, and an answer's digits decode as the reward reads them
    prompt = tokenizer.encode("copy:381=")
    assert len(prompt) == 6 and tokenizer.unk_token_id not in prompt[1:] and 0 not in prompt
    assert tokenizer.decode(prompt) == "copy:381=" and tokenizer.decode(prompt[2:5]) == "381"
    assert tokenizer.decode([*prompt[2:5], 0], skip_special_tokens=True) == "381"
