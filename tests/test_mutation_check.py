"""The mutation check itself: a stale mutant is refused, a live one is applied exactly once, and
every mutant names tests that exist."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "mutation"))
from check import ROOT, apply, failure_kinds, tracked_files  # noqa: E402
from mutants import MUTANTS, Mutant  # noqa: E402


def test_apply_replaces_the_one_occurrence(tmp_path):
    (tmp_path / "m.py").write_text("a = 1\nb = 2\n")
    apply(Mutant("m", "claim", "m.py", "b = 2", "b = 3", ("t",)), tmp_path)
    assert (tmp_path / "m.py").read_text() == "a = 1\nb = 3\n"


@pytest.mark.parametrize("text", ["a = 1\n", "b = 2\nb = 2\n"])
def test_a_stale_mutant_is_refused(tmp_path, text):
    (tmp_path / "m.py").write_text(text)
    with pytest.raises(ValueError, match="occurs"):
        apply(Mutant("m", "claim", "m.py", "b = 2", "b = 3", ("t",)), tmp_path)


def test_every_mutant_matches_the_code_and_names_existing_tests():
    files = set(tracked_files(ROOT))
    assert len({m.id for m in MUTANTS}) == len(MUTANTS), "mutant ids must be unique"
    for mutant in MUTANTS:
        assert mutant.file in files, f"{mutant.id}: no file {mutant.file}"
        assert (ROOT / mutant.file).read_text().count(mutant.old) == 1, f"{mutant.id}: stale snippet"
        for test in mutant.tests:
            path, _, name = test.partition("::")
            assert path in files, f"{mutant.id}: no test file {path}"
            assert not name or f"def {name.split('[')[0]}(" in (ROOT / path).read_text(), f"{mutant.id}: no {test}"


def test_only_a_failed_assertion_counts_as_a_kill(tmp_path):
    """A timeout, a wait past its deadline, another exception or a fixture error proves nothing."""
    import subprocess

    (tmp_path / "test_kinds.py").write_text(
        "import time, pytest\n"
        "class WaitTimedOut(AssertionError): pass\n"
        "def test_assertion(): assert 1 == 2\n"
        "def test_did_not_raise():\n"
        "    with pytest.raises(ValueError): pass\n"
        "def test_crash(): raise RuntimeError('boom')\n"
        "def test_wait(): raise WaitTimedOut('not within 60 s')\n"
        "def test_hang(): time.sleep(30)\n"  # a hang for --timeout=2 to stop: it must be reported as a timeout
        "@pytest.fixture\n"
        "def broken(): raise OSError('setup')\n"
        "def test_fixture(broken): pass\n"
    )
    report = tmp_path / "report.xml"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--timeout=2", f"--junitxml={report}"]
    subprocess.run([*command, "test_kinds.py"], cwd=tmp_path, capture_output=True, check=False)
    kinds = {test.rpartition("::")[2]: kind for kind, test in failure_kinds(report.read_text())}
    assert kinds == {
        "test_assertion": "assertion",
        "test_did_not_raise": "assertion",
        "test_crash": "crash",
        "test_wait": "timeout",
        "test_hang": "timeout",
        "test_fixture": "crash",
    }
