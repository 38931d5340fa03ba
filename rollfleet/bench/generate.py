"""Output tokens/s of the embedded engine over HTTP, beside transformers, against the HBM roofline.

    rollfleet bench generate [--cases 64x8x256,16x8x32,1x1x256] [--engines embedded,embedded_batch,generate,...]
                             [--device cuda] [--hidden 2048 --layers 24 --vocab 151936] [--repeats 2] [--json F]

A case is prompts x n x new tokens: that many prompts of `--prompt-tokens` (64) random token ids, n
samples each, `new tokens` each at temperature 1, EOS ignored. The model is the benchmarks' shape
(rollfleet.bench.shapes: Qwen3, hidden 2048, 24 layers, vocab 151,936, 2.08B parameters) with random
weights, written once to a temp dir with a word-level tokenizer of the vocabulary's size. Each engine
runs each case in a process of its own (rollfleet/bench/generate_engines.py says how each is driven):
- embedded: the engine server driven as a GRPO step drives it (one /generate per prompt with n,
  return_logprob, all at once), `--max-running-requests` = prompts x n so the case runs as one batch;
- embedded_batch: the same, as ONE /generate of every prompt: embedded / embedded_batch is what the
  per-request path (parsing, admission, answers of each request) costs. Asked for together, the two
  run on one server, a pass of each in turn (their order swapped each pass), so a drift of the
  machine's load falls on both;
- embedded_waits: embedded with `--disable-overlap-schedule` (a decode step waits for its draws to reach
  the host before the next is launched): embedded / embedded_waits is what the overlap (kv/overlap.py) gains;
- generate: transformers `model.generate` on one left-padded batch, num_return_sequences n;
- generate_batch: transformers continuous batching (`model.generate_batch`, TRL's GRPO path).
Every engine first runs the case's batch for a few tokens, then (transformers' engines, and the embedded
engine in its first shape) for the case's whole length (the embedded engine: at most 2,048 tokens), both
untimed, then `--repeats` timed passes.

Roofline: one forward per new token; the forward for token t reads the weights (all but the input
embedding table, of which it reads a row per sequence) and the KV cache live at that step, rows x
(prompt + t) tokens of layers x 2 x kv_heads x head_dim x dtype bytes each. Their sum over the case's
steps, over the bandwidth of a device-to-device copy measured in the same run (a buffer of
`--copy-gb` copied, read and written bytes over time, CUDA events), is the roofline's time: what the
case costs when only memory traffic counts (the prefill's compute and the attention's arithmetic are
left out, so the bound is optimistic). Printed per case: output tokens/s (median of the passes), ms
per decode step (wall time / new tokens, the prefill included), each engine over the roofline and
embedded over each transformers path and over embedded_batch; for the embedded engine, its own split
(prefill and decode steps, a decode step's mean time over the roofline's mean step, and the time
outside any step). A pass whose output token count is not prompts x n x new tokens makes the run fail
(the record says which).

Long outputs (RL's reasoning traces): `--cases 32x8x2048,16x8x8192 --engines embedded`; the bench
model's context is Qwen3's (40,960 tokens). A case whose KV does not fit the pool at once is preempted
and recomputed (the record's `preempted`), which its time then includes.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path

from rollfleet.bench.record import command_line, make_record, spread, start, write_record
from rollfleet.bench.roofline import model_figures, roofline
from rollfleet.bench.shapes import add_vocab_flag, write_model
from rollfleet.bench.worker_process import run_worker_process, stop_on_sigterm

ENGINES = ("embedded", "embedded_batch", "embedded_waits", "generate", "generate_batch")
DEFAULT_ENGINES = "embedded,embedded_batch,generate,generate_batch"  # embedded_waits when asked for
DEFAULT_CASES = "64x8x256,16x8x32,1x1x256"
FIRST_ID = 3  # after the tokenizer's special tokens (rollfleet.tiny_models.SPECIAL_TOKENS)


def parse_cases(text: str) -> list[tuple[int, int, int]]:
    cases = []
    for item in text.split(","):
        parts = item.strip().lower().split("x")
        if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise SystemExit(
                f"--cases {text!r}: {item!r} is not PROMPTSxNxNEW_TOKENS of positive integers (e.g. 16x8x32)"
            )
        cases.append(tuple(int(p) for p in parts))
    return cases


def case_name(case: tuple[int, int, int]) -> str:
    return "x".join(map(str, case))


def write_prompts(path: Path, count: int, length: int, vocab: int, seed: int) -> Path:
    draw = random.Random(seed)
    path.write_text(json.dumps([[draw.randrange(FIRST_ID, vocab) for _ in range(length)] for _ in range(count)]))
    return path


def run_worker(engine: str, args, scratch: Path, case: tuple[int, int, int] | None = None, prompts=None) -> dict:
    """One engine on one case (or the copy) in a process of its own; stopped after --timeout-s."""
    name = f"{engine}-{case_name(case)}" if case else engine
    out, log = scratch / f"{name}.json", scratch / f"{name}.log"
    command = [sys.executable, "-m", "rollfleet.bench.generate_engines", engine, "--out", str(out)]
    repeats = max(5, args.repeats) if engine == "copy" else args.repeats
    command += ["--device", args.device, "--dtype", args.dtype, "--repeats", str(repeats)]
    command += ["--model", str(scratch / "model"), "--copy-gb", str(args.copy_gb), "--timeout-s", str(args.timeout_s)]
    if case:
        command += ["--prompts", str(prompts), "--n", str(case[1]), "--new-tokens", str(case[2])]
    if args.logprob_values:
        command.append("--logprob-values")
    if args.engine_flags:
        command += ["--engine-flags", args.engine_flags]
    print(f"  {name} ...", flush=True)
    code = run_worker_process(name, command, log, args.timeout_s)
    if code is None:
        return {"engine": engine, "failure": f"not done after --timeout-s {args.timeout_s:g}", "exit_code": None}
    if code != 0 or not out.exists():
        tail = log.read_text(errors="replace")[-3000:]
        print(f"  {name}: FAILED, exit code {code}\n{tail[-1500:]}", flush=True)
        return {"engine": engine, "failure": f"exit code {code}", "exit_code": code, "log_tail": tail}
    answer = json.loads(out.read_text())
    flat = [p for item in answer.get("passes", []) for p in (item if isinstance(item, list) else [item])]
    passes = ", ".join(f"{p['seconds']:.3f} s {p.get('scheduler', '')}" for p in flat)
    print(f"  {name}: {passes}", flush=True)  # as it comes: a run cut short still says what it measured
    return answer


def run_engines(engines: list[str], args, scratch: Path, case, prompts) -> dict[str, dict]:
    """Engine -> its answer on `case`; embedded and embedded_batch, when both are asked for, run as
    one worker (`embedded_pair`: their passes take turns on one server) and are split back."""
    paired = "embedded" in engines and "embedded_batch" in engines
    answers = {}
    for engine in engines:
        if paired and engine == "embedded_batch":
            continue
        if paired and engine == "embedded":
            pair = run_worker("embedded_pair", args, scratch, case, prompts)
            for index, name in enumerate(("embedded", "embedded_batch")):
                answers[name] = {**pair, "engine": name}
                if "passes" in pair:
                    answers[name]["passes"] = [both[index] for both in pair["passes"]]
            continue
        answers[engine] = run_worker(engine, args, scratch, case, prompts)
    return answers


def engine_steps(passes: list[dict], prompt_tokens: int, prompts: int) -> dict:
    """The embedded engine's own split of a pass (medians over passes): prefill tokens over the
    prompts' tokens (1.0: a prompt's n samples share one prefill), its prefill and decode steps and
    their seconds, the pass's time outside any step (parsing, admission, answers, the client's reading
    of them) and its share of the pass, and the graph captures so far. Empty for engines that report none."""
    stats = [p["scheduler"] for p in passes if "prefill_tokens" in (p.get("scheduler") or {})]
    if not stats:
        return {}
    split = {"prefill_of_prompts": statistics.median(s["prefill_tokens"] for s in stats) / (prompts * prompt_tokens)}
    steps = ("prefill_steps", "decode_steps", "prefill_seconds", "decode_seconds", "graph_captures")
    for key in steps + ("device_waits", "device_wait_seconds"):
        if all(key in s for s in stats):
            split[key] = statistics.median(s[key] for s in stats)
    timed = [p for p in passes if "decode_seconds" in (p.get("scheduler") or {})]
    if timed:
        outside = [p["seconds"] - p["scheduler"]["prefill_seconds"] - p["scheduler"]["decode_seconds"] for p in timed]
        split["outside_steps_s"] = statistics.median(outside)
        split["outside_steps_share"] = statistics.median(o / p["seconds"] for o, p in zip(outside, timed))
    clocked = [p["scheduler"]["clock"] for p in passes if "clock" in (p.get("scheduler") or {})]
    if clocked:  # where that time went (generate_engines.outside_split), passes of one batch
        split["outside_split_s"] = {key: statistics.median(c[key] for c in clocked) for key in clocked[0]}
    return split


def case_summary(case, answers: dict[str, dict], limit: dict, prompt_tokens: int = 64) -> dict:
    """Per engine: tokens/s (spread), ms per decode step, share of the roofline, token counts checked,
    and the embedded engine's prefill share and step split (`engine_steps`)."""
    prompts, n, new_tokens = case
    expected = prompts * n * new_tokens
    engines, problems = {}, []
    for engine, answer in answers.items():
        if "failure" in answer:
            problems.append(f"{engine} {case_name(case)}: {answer['failure']}")
            continue
        passes = answer["passes"]
        short = [p["tokens"] for p in passes if p["tokens"] != expected]
        if short:
            problems.append(f"{engine} {case_name(case)}: {short} output tokens, expected {expected}")
        tok_s = statistics.median(p["tokens"] / p["seconds"] for p in passes)
        engines[engine] = {
            "tok_s": spread([p["tokens"] / p["seconds"] for p in passes]),
            "seconds": spread([p["seconds"] for p in passes]),
            "ms_per_step": statistics.median(p["seconds"] for p in passes) / new_tokens * 1e3,
            "of_roofline": tok_s / limit["tok_s"],
            "tokens_ok": not short,
            **engine_steps(passes, prompt_tokens, prompts),
        }
        split = engines[engine]
        if split.get("decode_steps"):  # the decode steps alone against the roofline's mean step
            split["decode_ms_per_step"] = split["decode_seconds"] / split["decode_steps"] * 1e3
            split["decode_over_roofline"] = split["decode_ms_per_step"] / (limit["seconds"] / limit["steps"] * 1e3)
    ratios = {}
    for other in ("embedded_batch", "embedded_waits", "generate", "generate_batch"):
        if "embedded" in engines and other in engines:
            ratios[f"embedded/{other}"] = engines["embedded"]["tok_s"]["median"] / engines[other]["tok_s"]["median"]
    summary = {"expected_tokens": expected, "roofline": limit, "engines": engines, "ratios": ratios}
    return {**summary, "problems": problems}


def table(cases: dict[str, dict]) -> str:
    lines = ["| case | engine | tok/s (median) | ms / step | / roofline | s per pass |", "|---|---|---|---|---|---|"]
    for name, case in cases.items():
        limit = case["roofline"]
        lines.append(
            f"| {name} | roofline | {limit['tok_s']:,.0f} | {limit['seconds'] / limit['steps'] * 1e3:.2f} | 1 "
            f"| {limit['seconds']:.3f} |"
        )
        for engine, figures in case["engines"].items():
            lines.append(
                f"| {name} | {engine} | {figures['tok_s']['median']:,.0f} | {figures['ms_per_step']:.2f} "
                f"| {figures['of_roofline']:.3f} | {figures['seconds']['median']:.2f} |"
            )
        ratios = ", ".join(f"{k} {v:.2f}" for k, v in case["ratios"].items())
        lines += [f"| {name} | ratios | {ratios} | | | |"] if ratios else []
        lines += [_steps_row(name, engine, f) for engine, f in case["engines"].items() if "prefill_of_prompts" in f]
    return "\n".join(lines)


def _steps_row(name: str, engine: str, f: dict) -> str:
    split = f"prefill {f['prefill_of_prompts']:.2f} x the prompts' tokens"
    if "decode_steps" in f:
        split += (
            f"; {f['prefill_steps']:.0f} prefill steps ({f['prefill_seconds']:.2f} s), "
            f"{f['decode_steps']:.0f} decode steps ({f['decode_seconds']:.2f} s)"
        )
    if "decode_over_roofline" in f:
        split += f"; {f['decode_ms_per_step']:.2f} ms a decode step, {f['decode_over_roofline']:.1f} x the roofline's"
    if "device_waits" in f:  # at these steps the device was still busy when the host came for the draws
        split += f"; the host waited for the device at {f['device_waits']:.0f} steps ({f['device_wait_seconds']:.2f} s)"
    if "outside_steps_s" in f:
        split += f"; outside steps {f['outside_steps_s']:.2f} s ({f['outside_steps_share']:.0%} of the pass)"
    if "outside_split_s" in f:
        parts = f["outside_split_s"]
        split += ": " + ", ".join(f"{key.removesuffix('_s').replace('_', ' ')} {parts[key] * 1e3:.0f}" for key in parts)
        split += " ms"
    return f"| {name} | {engine} steps | {split} | | | |"


def parse(argv: list[str] | None) -> argparse.Namespace:
    import torch

    p = argparse.ArgumentParser(prog="rollfleet bench generate", description=__doc__.split("\n")[0])
    p.add_argument("--cases", default=DEFAULT_CASES, help="prompts x n x new tokens, comma-separated")
    p.add_argument("--engines", default=DEFAULT_ENGINES, help=f"any of {', '.join(ENGINES)}")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default=None, help="default: bfloat16 on cuda")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=24)
    add_vocab_flag(p)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2, help="timed passes per engine and case (after a warm-up)")
    p.add_argument("--copy-gb", type=float, default=None, help="the bandwidth probe's buffer (default 2 GB, CPU 0.2)")
    p.add_argument("--timeout-s", type=float, default=300, help="one engine on one case, start to end")
    p.add_argument("--seed", type=int, default=0, help="of the weights and the prompts")
    p.add_argument("--json", default=None, help="write the record (rollfleet/bench/record.py) to this file")
    p.add_argument(
        "--logprob-values",
        action="store_true",
        help="embedded: ask for the logprobs as one list per sample (return_logprob_values, as rollfleet's "
        "GRPO driver does) instead of SGLang's [logprob, id, text] triples",
    )
    p.add_argument(
        "--engine-flags",
        default="",
        help="the embedded engines' further server flags, one string (e.g. '--rollfleet-shared-prefix-keys 0'): "
        "an A/B of a flag in one tree and one call",
    )
    args = p.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    args.copy_gb = args.copy_gb or (2.0 if args.device == "cuda" else 0.2)
    unknown = set(args.engines.split(",")) - set(ENGINES)
    if unknown:
        p.error(f"--engines {args.engines}: unknown {', '.join(sorted(unknown))}; choose from {', '.join(ENGINES)}")
    return args


def measure(args, scratch: Path) -> tuple[dict, dict, list[dict], dict]:
    """The model, the bandwidth, every engine on every case: (figures, bandwidth, answers, summaries)."""
    import torch

    model = write_model(scratch / "model", args.hidden, args.layers, getattr(torch, args.dtype), args.vocab, args.seed)
    figures = model_figures(model)
    copy = run_worker("copy", args, scratch)
    if "failure" in copy:
        raise SystemExit(f"the bandwidth probe failed: {copy['failure']}\n{copy.get('log_tail', '')}")
    bandwidth = spread([p["gb_per_s"] for p in copy["passes"]])
    answers, cases = [], {}
    for case in parse_cases(args.cases):
        prompts = write_prompts(
            scratch / f"prompts-{case_name(case)}.json", case[0], args.prompt_tokens, args.vocab, args.seed + case[0]
        )
        mine = run_engines(args.engines.split(","), args, scratch, case, prompts)
        answers += [{"case": case_name(case), **answer} for answer in mine.values()]
        limit = roofline(case, args.prompt_tokens, figures, bandwidth["median"])
        cases[case_name(case)] = case_summary(case, mine, limit, args.prompt_tokens)
    return figures, bandwidth, answers, cases


def main(argv: list[str] | None = None) -> None:
    args, started = parse(argv), start()
    stop_on_sigterm()  # stopped from outside: the running worker goes too, saying where it got to
    command = command_line(["rollfleet", "bench", "generate"], argv)
    with tempfile.TemporaryDirectory(prefix="rf-bench-generate-") as scratch:
        figures, bandwidth, answers, cases = measure(args, Path(scratch))
        text = json.dumps(answers).replace(scratch, "$WORK")  # logs name the temp dir, a path of this machine
    answers = json.loads(text)
    problems = [p for case in cases.values() for p in case.pop("problems")]
    print(f"device copy {bandwidth['median']:.1f} GB/s (read + written); model {figures['weights_bytes'] / 1e9:.2f} GB")
    rendered = table(cases)
    print(rendered)
    for problem in problems:
        print(f"  FAILED: {problem}")
    config = {k: v for k, v in vars(args).items() if k != "json"}
    repeats = [
        {"case": a["case"], "engine": a["engine"], "pass": i + 1, **p}
        for a in answers
        for i, p in enumerate(a.get("passes", []))
    ]
    failed = [a for a in answers if "failure" in a]
    summary = {"copy_gb_per_s": bandwidth, "model": figures, "cases": cases, "failed_runs": failed, "table": rendered}
    failure = "; ".join(problems) or None
    record = make_record("generate", command, config, repeats, summary, not problems, failure, started)
    write_record(args.json, record)
    if problems:
        sys.exit(1)


if __name__ == "__main__":
    main()
