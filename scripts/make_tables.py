"""Regenerate the result tables of docs/benchmarks.md and README.md from the records in docs/results/,
and the config reference (docs/config.md) from the config's pydantic models.

    python scripts/make_tables.py            # rewrite the tables in place
    python scripts/make_tables.py --check    # exit 1 if a committed table differs from its records

A table lives between `<!-- table:NAME -->` and `<!-- /table -->`; everything between the markers is
generated (NAME: weight-sync, recovery, batching, grpo-step, generate, demo, demo-summary,
config-reference). Records are the JSON files the benchmarks write with --json
(rollfleet/bench/record.py); a GPU run's files dropped into docs/results/ join the tables on the next
run of this script. The config reference is rollfleet.config.reference's, of this checkout's models.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # the config reference documents this checkout's models, not an installed copy
from rollfleet.config.reference import reference  # noqa: E402

RESULTS = REPO / "docs" / "results"
DOCS = [REPO / "docs" / "benchmarks.md", REPO / "README.md", REPO / "docs" / "config.md"]
MARKER = re.compile(r"(<!-- table:([\w-]+) -->\n)(.*?)(<!-- /table -->)", re.S)


def load_records() -> list[tuple[str, dict]]:
    return [(p.name, json.loads(p.read_text())) for p in sorted(RESULTS.glob("*.json"))]


def _machine(record: dict) -> str:
    m = record["machine"]
    if m["gpus"]:
        names = sorted(set(m["gpus"]))
        return ", ".join(f"{m['gpus'].count(n)} x {n}" for n in names)
    return f"{m['cpu_count']}-core CPU ({m['cpu']})"


def _code(record: dict) -> str:
    code = record["code"]
    revision = (code["revision"] or "unknown")[:8]
    return revision + (" (dirty)" if code["dirty"] else "")


def _range(d: dict, fmt: str = ".2f", scale: float = 1.0) -> str:
    return f"{d['median'] * scale:{fmt}} ({d['min'] * scale:{fmt}}-{d['max'] * scale:{fmt}})"


def _source(name: str, record: dict) -> str:
    loads = [record["machine"].get(k) for k in ("load_avg_at_start", "load_avg_at_end")]
    load = f", 1-min load {loads[0][0]:.1f} -> {loads[1][0]:.1f}" if all(loads) else ""
    return f"`{name}` ({record['date_utc'][:10]}, code {_code(record)}, {_machine(record)}{load})"


def weight_sync(records: list[tuple[str, dict]]) -> str:
    head = (
        "| transport | device | model | bucket | raw GB/s | sync GB/s | **sync / raw** | + verify GB/s "
        "| **(+ verify) / raw** | verify ms | old-method ratio | n | record |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    rows = []
    mine = [(n, r) for n, r in records if r["benchmark"] == "weight-sync"]
    for name, r in sorted(mine, key=lambda nr: (nr[1]["config"]["device"], nr[1]["config"]["transport"], nr[0])):
        c, s = r["config"], r["summary"]
        if not r["ok"]:
            rows.append(
                f"| {c['transport']} | {c['device']} | - | {c['bucket_mb']:g} MB | verification failed |"
                f" - | - | - | - | - | - | {len(r['repeats'])} | {_source(name, r)} |"
            )
            continue
        # the tensor transport's resident path (no buckets: the engine keeps the parameters mapped)
        resident = any(row.get("resident") == "kept" for row in r["repeats"])
        bucket = "resident" if resident else f"{c['bucket_mb']:g} MB"
        rows.append(
            f"| {c['transport']} | {c['device']} | {s['model_gb']:.3g} GB | {bucket} "
            f"| {_range(s['raw_gb_per_s'])} | {_range(s['sync_gb_per_s'])} | **{s['ratio_sync_to_raw']:.2f}** "
            f"| {_range(s['sync_plus_verify_gb_per_s'])} | **{s['ratio_sync_plus_verify_to_raw']:.2f}** "
            f"| {_range(s['verify_s'], '.0f', 1000)} | {s['old_method']['ratio_sync_to_raw']:.2f} "
            f"| {s['sync_s']['n']} | {_source(name, r)} |"
        )
    return head + "\n".join(rows) + "\n" if rows else "(no records)\n"


def recovery(records: list[tuple[str, dict]]) -> str:
    phases = ("detect", "restart", "setup", "restore", "expected", "verify", "total")
    out = []
    for name, r in [(n, r) for n, r in records if r["benchmark"] == "recovery"]:
        s = r["summary"]
        out.append(
            ("\n" if out else "") + f"{s['device']}, checkpoint {s['checkpoint_mb']:.1f} MB, median (min-max) of "
            f"{r['config']['repeats']} rounds, seconds; record {_source(name, r)}:\n\n"
        )
        out.append("| path | " + " | ".join(phases) + " |\n|---|" + "---|" * len(phases) + "\n")
        for path, figures in s["paths"].items():
            cells = [_range(figures[k], ".3f") if figures[k]["max"] > 0 else "-" for k in phases]
            cells[-1] = f"**{cells[-1]}**"
            out.append(f"| {path} | " + " | ".join(cells) + " |\n")
    return "".join(out) or "(no records)\n"


def grpo_step(records: list[tuple[str, dict]]) -> str:
    phases = ("generate", "train", "sync", "sleep_wake", "recovery", "total")
    out = []
    for name, r in [(n, r) for n, r in records if r["benchmark"] == "grpo-step"]:
        c, s = r["config"], r["summary"]
        limits, pinned = s["ceilings"], s["ceilings"].get("pinned_copy_gb_per_s")
        out.append(
            ("\n" if out else "")
            + f"hidden {c['hidden']}, {c['layers']} layers ({c['model_bytes'] / 1e9:.2f} GB {c['dtype']} on disk), "
            f"{c['prompts']} prompts x n={c['n']} x {c['new_tokens']} new tokens; median seconds over steps "
            f"{c['skip'] + 1}-{c['steps']}; record {_source(name, r)}{_overrides(c)}:\n\n"
        )
        out.append(
            "| run | " + " | ".join(phases) + " | sync bytes | sync ceiling s | **ceiling / sync** "
            "| sleep/wake GB/s | **/ pinned copy** |\n|---|" + "---|" * (len(phases) + 5) + "\n"
        )
        for run, f in s["phases"].items():
            limit = limits.get(f"{run}_sync", {}).get("median")
            ratio = f"**{limit / f['sync']:.2f}**" if limit and f["sync"] else "-"
            rate = f.get("sleep_wake_gbps")
            pinned_rate = min(pinned["h2d_gbps"], pinned["d2h_gbps"]) if pinned else None
            against = f"**{rate / pinned_rate:.2f}**" if rate and pinned_rate else "-"
            cells = " | ".join(f"{f[p]:.2f}" for p in phases)
            out.append(
                f"| {run} | {cells} | {f.get('sync_bytes', 0) / 1e9:.2f} GB | {limit or 0:.3f} | {ratio} "
                f"| {f'{rate:.1f}' if rate else '-'} | {against} |\n"
            )
        out.append(_sync_split(s["phases"]))
        if not r["ok"]:
            out.append(f"\nThe record is marked failed: {r['failure']} (the steps above completed).\n")
    return "".join(out) or "(no records)\n"


def _overrides(config: dict) -> str:
    """The run's config overrides that change what it measures (where its logs went does not)."""
    sets = [f"`{item}`" for item in config.get("set", []) if not item.startswith("rollout.log_dir=")]
    return f", with {', '.join(sets)}" if sets else ""


def _sync_split(phases: dict[str, dict]) -> str:
    """Where each run's sync went (ms, medians; records from code that logs `sync_phases`): the
    engines' weight resume, the sender's phases, its call as the fleet saw it, the verification."""
    keys = sorted({k for f in phases.values() for k in f if k.startswith("sync/")})
    if not keys:
        return ""
    names = [k.removeprefix("sync/") for k in keys]
    rows = ["\nThe sync's split, ms (sender = the sender's own seconds, inside send_call):\n\n"]
    rows.append("| run | " + " | ".join(names) + " |\n|---|" + "---|" * len(names) + "\n")
    for run, f in phases.items():
        rows.append(f"| {run} | " + " | ".join(f"{f.get(k, 0.0) * 1e3:.1f}" for k in keys) + " |\n")
    return "".join(rows)


GENERATE_ENGINES = ("embedded", "embedded_batch", "generate", "generate_batch")
GENERATE_RATIOS = ("embedded/embedded_batch", "embedded/generate", "embedded/generate_batch")


LOGPROB_VALUES = "; the logprobs as one list a sample (--logprob-values)"


def generate(records: list[tuple[str, dict]]) -> str:
    """Per `rollfleet bench generate` record: one row per case, each engine's output tokens/s beside
    the roofline of the case's decode steps, and the ratios."""
    out = []
    for name, r in [(n, r) for n, r in records if r["benchmark"] == "generate"]:
        c, s = r["config"], r["summary"]
        out.append(
            ("\n" if out else "") + f"hidden {c['hidden']}, {c['layers']} layers, vocab {c['vocab']:,} "
            f"({s['model']['weights_bytes'] / 1e9:.2f} GB {c['dtype']}), prompts of {c['prompt_tokens']} tokens, "
            f"on {c['device']}{LOGPROB_VALUES if c.get('logprob_values') else ''}; "
            f"device copy {_range(s['copy_gb_per_s'], '.0f')} GB/s; output tokens/s, median "
            f"(min-max) of {c['repeats']} passes; ms / step = wall time / new tokens; record {_source(name, r)}:\n\n"
        )
        heads = [f"{e} tok/s" for e in GENERATE_ENGINES] + ["embedded ms / step"]
        heads += [f"**{k.replace('/', ' / ')}**" for k in GENERATE_RATIOS]
        heads += [f"{e} / roofline" for e in GENERATE_ENGINES]
        out.append("| prompts x n x new tokens | roofline tok/s | " + " | ".join(heads) + " |\n")
        out.append("|---|---|" + "---|" * len(heads) + "\n")
        for case, f in s["cases"].items():
            engines, ratios = f["engines"], f["ratios"]
            speeds = [_range(engines[e]["tok_s"], ",.0f") if e in engines else "-" for e in GENERATE_ENGINES]
            step = f"{engines['embedded']['ms_per_step']:.1f}" if "embedded" in engines else "-"
            shares = [f"{engines[e]['of_roofline']:.3f}" if e in engines else "-" for e in GENERATE_ENGINES]
            against = [f"**{ratios[k]:.2f}**" if k in ratios else "-" for k in GENERATE_RATIOS]
            cells = [f"{f['roofline']['tok_s']:,.0f}", *speeds, step, *against, *shares]
            out.append(f"| {case} | " + " | ".join(cells) + " |\n")
        if not r["ok"]:
            out.append(f"\nThe record is marked failed: {r['failure']}\n")
    return "".join(out) or "(no records)\n"


def batching(records: list[tuple[str, dict]]) -> str:
    head = "| one by one tokens/s | all at once tokens/s | speed-up | requests x new tokens | n | record |\n"
    rows = [head + "|---|---|---|---|---|---|\n"]
    for name, r in [(n, r) for n, r in records if r["benchmark"] == "batching"]:
        c, s = r["config"], r["summary"]
        rows.append(
            f"| {_range(s['one_by_one_tok_s'], '.0f')} | {_range(s['all_at_once_tok_s'], '.0f')} "
            f"| **{s['speed_up']:.1f}x** | {c['requests']} x {c['max_new_tokens']} | {c['repeats']} "
            f"| {_source(name, r)} |\n"
        )
    return "".join(rows) if len(rows) > 1 else "(no records)\n"


def _demo_records(records):
    return [(n, r) for n, r in records if r["benchmark"] == "demo"]


def _seeding(record: dict) -> str:
    """Whether the demo's engine drew its samples from grpo.seed (records before grpo.seed_sampling: not)."""
    if record["config"].get("sampling_seeded"):
        return "the engine's sampling seeded from grpo.seed"
    return "the engine's sampling not seeded"


def demo(records: list[tuple[str, dict]]) -> str:
    out = []
    for name, r in _demo_records(records):
        window = r["summary"]["window_steps"]
        overrides = " ".join(r["config"].get("overrides") or [])
        given = f"; `{r['config']['config_file']}` with `{overrides}`" if overrides else ""
        out.append(f"Record {_source(name, r)}; {_seeding(r)}{given}:\n\n")
        out.append(
            f"| grpo.seed | steps | reward, first {window} steps | reward, last {window} steps "
            "| seconds of steps | end to end |\n|---|---|---|---|---|---|\n"
        )
        for run in r["repeats"]:
            out.append(
                f"| {run['seed']} | {run['steps']} | {run['reward_first']:.3f} | **{run['reward_last']:.2f}** "
                f"| {run['seconds_of_steps']:.0f} | {run['seconds_end_to_end']:.0f} |\n"
            )
    return "".join(out) or "(no records)\n"


def _span(low: float, high: float, spec: str) -> str:
    """A range as low-high, or one figure where both ends print alike."""
    a, b = format(low, spec), format(high, spec)
    return a if a == b else f"{a}-{b}"


def demo_summary(records: list[tuple[str, dict]]) -> str:
    found = _demo_records(records)
    if not found:
        return "(no records)\n"
    name, r = found[-1]
    s = r["summary"]
    first, last, steps = s["reward_first"], s["reward_last"], s["seconds_of_steps"]
    seeds = ", ".join(str(x) for x in r["config"]["seeds"])
    other = [100 * run["other_share_of_step_time"] for run in r["repeats"]]
    return (
        f"Mean reward goes from {first['min']:.3f}-{first['max']:.3f} (first {s['window_steps']} steps) to "
        f"{last['min']:.2f}-{last['max']:.2f} (last {s['window_steps']}; median {last['median']:.2f}) over "
        f"{r['repeats'][0]['steps']} steps in {last['n']} runs (grpo.seed {seeds}; {_seeding(r)}), "
        f"{_span(steps['min'], steps['max'], '.0f')} s of steps each on "
        f'a {_machine(r)} shared with other work. "other" (framework overhead outside generate, reward, '
        f"train, sync, sleep/wake and the recovery checkpoint) is {min(other):.2f}-{max(other):.2f}% of step time. "
        f"Record: `docs/results/{name}`, made by `python scripts/demo_seeds.py`.\n"
    )


TABLES: dict[str, Callable[[list[tuple[str, dict]]], str]] = {
    "weight-sync": weight_sync,
    "recovery": recovery,
    "batching": batching,
    "grpo-step": grpo_step,
    "generate": generate,
    "demo": demo,
    "demo-summary": demo_summary,
    "config-reference": lambda records: reference(),
}


def render(text: str, records: list[tuple[str, dict]]) -> str:
    def replace(match: re.Match) -> str:
        name = match.group(2)
        if name not in TABLES:
            raise SystemExit(f"unknown table marker {name!r}; known: {', '.join(TABLES)}")
        return match.group(1) + TABLES[name](records) + match.group(4)

    return MARKER.sub(replace, text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/make_tables.py")
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 if a table is out of date")
    args = parser.parse_args(argv)
    records, stale = load_records(), []
    for doc in DOCS:
        text = doc.read_text()
        new = render(text, records)
        if new != text:
            stale.append(doc.relative_to(REPO))
            if not args.check:
                doc.write_text(new)
    if stale:
        print(("out of date: " if args.check else "rewrote: ") + ", ".join(map(str, stale)))
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
