"""The mutation check: each invariant the project claims has a mutant that breaks it, and the
tests named for that mutant must fail on it.

    python tests/mutation/check.py            # every mutant (`make mutants`)
    python tests/mutation/check.py -k verify  # those whose id contains "verify"
    python tests/mutation/check.py --list

For each mutant: copy the tracked tree (plus untracked, not ignored files) to a temporary
directory, replace one exact snippet of one file (it must occur exactly once, else the mutant is
stale and the check fails), run the mutant's tests there with pytest, and require that one of them
fails on an assertion (pytest's junit report: an AssertionError, or pytest's own Failed such as
"DID NOT RAISE"). A failure that proves nothing about the claim (a timeout, a wait past its
deadline, another exception, an error in a fixture) runs the tests once more; a mutant whose tests
pass, or that fails on no assertion twice, fails the check.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from xml.etree import ElementTree

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mutants import MUTANTS, Mutant  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def tracked_files(root: Path) -> list[str]:
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=root, check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    return [name for name in out.split("\0") if name and (root / name).is_file()]


def copy_tree(root: Path, destination: Path) -> None:
    for name in tracked_files(root):
        target = destination / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / name, target)


def apply(mutant: Mutant, tree: Path) -> None:
    path = tree / mutant.file
    text = path.read_text()
    count = text.count(mutant.old)
    if count != 1:
        raise ValueError(
            f"mutant {mutant.id}: the snippet occurs {count} times in {mutant.file} (needs exactly 1): "
            "the code moved on; update tests/mutation/mutants.py"
        )
    path.write_text(text.replace(mutant.old, mutant.new))


NOT_A_VERDICT = ("from pytest-timeout", "WaitTimedOut")  # a test that ran out of time proves nothing


def failure_kinds(junit_xml: str) -> list[tuple[str, str]]:
    """(kind, test) per failed or erred test of a pytest junit report: kind "assertion" when the
    test failed on an assertion, else "timeout" or "crash"."""
    kinds = []
    for case in ElementTree.fromstring(junit_xml).iter("testcase"):
        test = f"{case.get('classname')}::{case.get('name')}"
        for element in case:
            if element.tag == "error":
                kinds.append(("crash", test))
            elif element.tag == "failure":
                text = f"{element.get('message', '')}\n{element.text or ''}"
                raised = (element.text or "").strip().splitlines()[-1:] or [""]
                if any(marker in text for marker in NOT_A_VERDICT):
                    kinds.append(("timeout", test))
                elif raised[0].endswith((": AssertionError", ": Failed")):
                    kinds.append(("assertion", test))
                else:
                    kinds.append(("crash", test))
    return kinds


def run_tests(mutant: Mutant, tree: Path, timeout_s: float) -> tuple[int, list[tuple[str, str]], str]:
    """pytest's exit status, the failures' kinds, and its last line."""
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONDONTWRITEBYTECODE": "1"}
    if (ROOT / ".sglang-site").is_dir():  # ignored, so not copied: the contract tests read it from here
        env.setdefault("ROLLFLEET_SGLANG_SITE", str(ROOT / ".sglang-site"))
    report = tree / "mutant-report.xml"
    command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", f"--junitxml={report}"]
    try:
        done = subprocess.run(
            [*command, *mutant.tests], cwd=tree, env=env, capture_output=True, text=True, timeout=timeout_s
        )
    except subprocess.TimeoutExpired:
        return 124, [("timeout", "the whole run")], f"timed out after {timeout_s:.0f} s"
    lines = (done.stdout + done.stderr).strip().splitlines()
    kinds = failure_kinds(report.read_text()) if report.is_file() else []
    return done.returncode, kinds, lines[-1] if lines else ""


def check(mutant: Mutant, timeout_s: float) -> tuple[bool, str, float]:
    """Killed: a named test failed on an assertion. A run that failed on none (a timeout, a crash)
    is run once more before the mutant counts as survived."""
    start, details = time.perf_counter(), []
    with tempfile.TemporaryDirectory(prefix=f"mutant-{mutant.id}-") as scratch:
        tree = Path(scratch)
        copy_tree(ROOT, tree)
        apply(mutant, tree)
        for _ in range(2):
            status, kinds, last_line = run_tests(mutant, tree, timeout_s)
            details.append(f"pytest exit {status} ({', '.join(k for k, _ in kinds) or 'no failure'}): {last_line}")
            killed = status == 1 and any(kind == "assertion" for kind, _ in kinds)
            if killed or status == 0:  # a verdict: killed, or survived with every test passing
                break
    return killed, "; then ".join(details), time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-k", default="", help="only mutants whose id contains this")
    parser.add_argument("--list", action="store_true", help="list the mutants and their tests")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="per mutant")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTANTS if args.k in m.id]
    if args.list:
        for m in chosen:
            print(f"{m.id}: {m.claim}\n    {m.file}; tests: {' '.join(m.tests)}")
        return 0
    survivors, start = [], time.perf_counter()
    for mutant in chosen:
        try:
            killed, detail, seconds = check(mutant, args.timeout_s)
        except ValueError as exc:
            killed, detail, seconds = False, str(exc), 0.0
        print(f"{'killed  ' if killed else 'SURVIVED'} {mutant.id:<32} {seconds:6.1f} s  {detail}", flush=True)
        if not killed:
            survivors.append(mutant.id)
    print(f"{len(chosen) - len(survivors)}/{len(chosen)} mutants killed in {time.perf_counter() - start:.0f} s")
    if survivors:
        print("survived (the tests do not guard these claims): " + ", ".join(survivors))
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
