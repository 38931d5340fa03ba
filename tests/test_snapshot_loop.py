"""Recovery snapshots inside a real GRPO run (Ray, an embedded engine, the FSDP2 trainer on gloo): a
single-engine fleet ('auto') snapshots in the background, each snapshot is registered only once
complete, and closing the run waits for the last one."""

from __future__ import annotations

import pytest
import torch

from rollfleet.wire.hf_files import read_checkpoint
from tests.test_grpo_loop import run_config, train_rows

# one Ray (conftest's) for the module's runs: train() leaves running a Ray it did not start, which
# saves each run Ray's start and shutdown (seconds of CPU on this machine)
pytestmark = pytest.mark.usefixtures("local_ray")


def test_single_engine_run_snapshots_in_the_background(qwen3_dir, tmp_path):
    cfg, temp = run_config(qwen3_dir, tmp_path, "weight_sync.transport=tensor", "grpo.steps=3")
    assert cfg.recovery_snapshot_every == 1  # 'auto' with one engine
    rows = train_rows(cfg, temp, tmp_path)
    written = [v for r in rows for v in r["snapshot_versions_written"]]
    skipped = sum(r["snapshot_skipped"] for r in rows)
    assert written and skipped + len(written) <= 3  # each due snapshot was written or counted as skipped
    for row in rows:
        assert row["time/recovery"] < row["time/total"]
        if row["snapshot_versions_written"]:  # its host copy ran on the trainer's thread, off the step
            assert row["snapshot_copy_seconds"] > 0
        assert row["sleep_wake_bytes"] == 0 and row["sleep_wake_ceiling_gbps"] is None  # CPU: nothing moves
    recovery = tmp_path / "recovery"
    names = sorted(p.name for p in recovery.iterdir())
    assert not [n for n in names if n.endswith(".partial")], names  # closing waited for the last write
    if rows[-1]["snapshot_skipped"]:
        assert "version-3" not in names
        return
    # the last step's snapshot was started: closing the run waited for it, and it holds exactly the
    # weights the run ended with
    snapshot, final = read_checkpoint(recovery / "version-3"), read_checkpoint(tmp_path / "checkpoints" / "hf-step-3")
    assert set(snapshot) == set(final) and all(torch.equal(snapshot[k], final[k]) for k in final)
