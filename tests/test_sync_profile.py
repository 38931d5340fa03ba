"""ROLLFLEET_SYNC_PROFILE (rollfleet.train.sync_profile): the chosen push of a rank runs under
torch.profiler and leaves its tables; the others, and every push when it is unset, run as they are."""

from __future__ import annotations

import torch

from rollfleet.train.sync_profile import DIR_ENV, PUSH_ENV, SyncProfiler


def a_push() -> float:
    x = torch.ones(256, 256)
    return float((x @ x).sum())


def test_the_chosen_push_is_profiled_and_returns_what_the_push_returned(tmp_path, monkeypatch):
    monkeypatch.setenv(DIR_ENV, str(tmp_path / "profiles"))
    monkeypatch.setenv(PUSH_ENV, "2")
    profiler = SyncProfiler(rank=1)
    results = [profiler.around(a_push) for _ in range(3)]
    assert results == [256.0**3] * 3
    written = sorted(p.name for p in (tmp_path / "profiles").iterdir())
    assert written == ["sync-profile-rank1-push2.txt"]
    text = (tmp_path / "profiles" / written[0]).read_text()
    assert text.startswith("push 2 of rank 1: ") and "by host time" in text and "aten::mm" in text


def test_unset_no_push_is_profiled(tmp_path, monkeypatch):
    monkeypatch.delenv(DIR_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    profiler = SyncProfiler(rank=0)
    assert [profiler.around(a_push) for _ in range(4)] == [256.0**3] * 4
    assert profiler.pushes == 4 and list(tmp_path.iterdir()) == []
