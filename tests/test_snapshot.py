"""Recovery snapshots off the critical path and the colocated memory moves, on CPU: host buffers
reused across steps, the background writer (atomic rename, one write at a time, skip, error, cancel,
a process killed mid-write), the FSDP2 trainer's offload/onload through reused buffers (gloo), the
byte accounting, the trainer's memory given back at the end of its turn, and the 'auto' interval."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helper_processes import start_method
from waits import wait_until

from rollfleet.config import ConfigError, load_config
from rollfleet.fleet.colocation import freed_bytes
from rollfleet.tiny_models import make_tiny_model
from rollfleet.train.host_copy import HostBuffers, pinned_copy_ceiling
from rollfleet.train.metrics import TRAINER_MEMORY, _moves_text, sleep_wake_figures
from rollfleet.train.snapshot import SnapshotCancelled, SnapshotWriter
from rollfleet.wire.hf_files import read_checkpoint
from rollfleet.wire.net import free_port


def weights(count: int = 4, size: int = 1000, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.weight": torch.randn(size, generator=g) for i in range(count)}


class GatedTensors(Mapping):
    """Tensors whose iteration stops after the first until `gate` is set (a slow disk, made
    deterministic), or raises `error` there."""

    def __init__(self, tensors: dict, gate: threading.Event | None = None, error: Exception | None = None):
        self.tensors, self.gate, self.error = tensors, gate, error
        self.reached = threading.Event()

    def __getitem__(self, key):
        return self.tensors[key]

    def __len__(self):
        return len(self.tensors)

    def __iter__(self):
        for index, key in enumerate(self.tensors):
            if index == 1:
                self.reached.set()
                if self.error is not None:
                    raise self.error
                if self.gate is not None:
                    self.gate.wait(30)
            yield key


# ---- host buffers -------------------------------------------------------------------------------


def test_host_buffers_are_reused_while_shape_and_dtype_hold():
    buffers = HostBuffers(pin=False)
    first = buffers.copy_in("w", torch.ones(3, 4))
    again = buffers.copy_in("w", torch.full((3, 4), 2.0))
    assert again.data_ptr() == first.data_ptr() and buffers.allocations == 1
    assert torch.equal(first, torch.full((3, 4), 2.0))  # the same buffer holds the latest copy
    cast = buffers.copy_in("w", torch.ones(3, 4), torch.bfloat16)  # a dtype change: a new buffer
    assert cast.dtype == torch.bfloat16 and buffers.allocations == 2
    buffers.copy_in("w", torch.ones(5))
    assert buffers.allocations == 3 and buffers.nbytes == 5 * 4


def test_no_copy_ceiling_on_cpu():
    assert pinned_copy_ceiling(1 << 20, "cpu") is None


# ---- the background writer ------------------------------------------------------------------------


def test_writer_writes_an_hf_directory_renamed_when_complete(qwen3_dir, tmp_path):
    writer = SnapshotWriter(tmp_path / "recovery", qwen3_dir)
    tensors = weights()
    future = writer.start("3", tensors)
    result = future.result(30)
    assert result.version == "3" and result.directory == str(tmp_path / "recovery" / "version-3")
    assert result.bytes == sum(t.numel() * 4 for t in tensors.values()) and result.seconds > 0
    loaded = read_checkpoint(result.directory)
    assert set(loaded) == set(tensors) and all(torch.equal(loaded[k], v) for k, v in tensors.items())
    assert (Path(result.directory) / "config.json").is_file()  # an engine can load it
    assert sorted(p.name for p in (tmp_path / "recovery").iterdir()) == ["version-3"]


def test_a_snapshot_due_while_the_last_writes_is_skipped_and_old_versions_pruned(qwen3_dir, tmp_path):
    writer = SnapshotWriter(tmp_path, qwen3_dir, keep=2)
    gate = threading.Event()
    slow = GatedTensors(weights(), gate)
    first = writer.start("1", slow)
    assert slow.reached.wait(10) and writer.busy
    assert writer.start("2", weights(seed=1)) is None  # skipped: nothing started, nothing waited for
    assert not (tmp_path / "version-1").exists()  # not complete: only the partial directory
    assert (tmp_path / "version-1.partial").is_dir()
    gate.set()
    assert first.result(30).version == "1" and not writer.busy
    for version in ("2", "3"):
        writer.start(version, weights(seed=int(version))).result(30)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["version-2", "version-3"]


def test_a_failed_write_leaves_no_directory(qwen3_dir, tmp_path):
    writer = SnapshotWriter(tmp_path, qwen3_dir)
    future = writer.start("5", GatedTensors(weights(), error=OSError("disk full")))
    with pytest.raises(OSError, match="disk full"):
        future.result(30)
    assert list(tmp_path.iterdir()) == []
    assert writer.start("6", weights()).result(30).version == "6"  # the writer goes on


def test_closing_with_cancel_stops_the_write_and_removes_it(qwen3_dir, tmp_path):
    writer = SnapshotWriter(tmp_path, qwen3_dir)
    gate = threading.Event()
    slow = GatedTensors(weights(), gate)
    future = writer.start("7", slow)
    assert slow.reached.wait(10)
    closer = threading.Thread(target=writer.close, kwargs={"cancel": True})
    closer.start()
    wait_until(lambda: writer.cancelling, what="the cancel asked", alive=closer.is_alive)
    gate.set()  # the write resumes, sees the cancel at its next tensor
    closer.join()
    with pytest.raises(SnapshotCancelled):
        future.result(5)
    assert list(tmp_path.iterdir()) == []


KILLED_WRITER = """
import sys, threading, torch
from rollfleet.train.snapshot import SnapshotWriter
root, config_dir = sys.argv[1], sys.argv[2]
class Stalling(dict):  # a file per tensor, then the write stalls for good: the test never races its end
    def items(self):
        yield from list(super().items())
        threading.Event().wait()
writer = SnapshotWriter(root, config_dir, shard_bytes=1_300_000)
print("writing", flush=True)
writer.start("9", Stalling({f"w{i}": torch.randn(300_000) for i in range(3)}))
threading.Event().wait()
"""


def test_a_process_killed_mid_write_leaves_nothing_a_restore_takes(qwen3_dir, tmp_path):
    root = tmp_path / "recovery"
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_WRITER, str(root), str(qwen3_dir)],
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])},
    )
    partial = root / "version-9.partial"
    deadline = time.monotonic() + 60
    while not list(partial.glob("*.safetensors")) and time.monotonic() < deadline:
        time.sleep(0.005)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)
    assert list(partial.glob("*.safetensors")), "the writer never started"
    assert not (root / "version-9").exists()  # never renamed: no directory a restore could take
    SnapshotWriter(root, qwen3_dir)  # the next run's writer removes the half directory
    assert list(root.iterdir()) == []


# ---- offload/onload of an FSDP2 trainer through reused buffers (gloo, CPU) ------------------------


def _offload_worker(rank: int, port: int, model_dir: str, out: str) -> None:
    from rollfleet.train.fsdp import PolicyTrainer, TrainConfig
    from rollfleet.train.offload import Offloader
    from rollfleet.train.sharding import init_distributed
    from tests.test_trainer import full_weights, make_batch

    init_distributed(rank, 2, master_port=port, backend="gloo")
    torch.set_num_threads(1)
    try:
        config = TrainConfig(lr=1e-2, micro_batch_size=2)
        moving, staying = PolicyTrainer(model_dir, config), PolicyTrainer(model_dir, config)
        offloader = Offloader(torch.device("cpu"))  # the GPU path's steps, with plain host tensors
        result = {"moves": [], "ptrs": []}
        for step in range(3):
            for trainer in (moving, staying):
                trainer.train_step(make_batch(step))
            offloaded = offloader.offload([moving.model], moving.optimizer)
            ptrs = [p._local_tensor.data_ptr() for p in moving.model.parameters()]
            onloaded = offloader.onload([moving.model], moving.optimizer)
            result["moves"].append((offloaded, onloaded))
            result["ptrs"].append(ptrs)
        result["moving"], result["staying"] = full_weights(moving), full_weights(staying)
        result["local_bytes"] = sum(p._local_tensor.numel() * 4 for p in moving.model.parameters())
        result["optim_bytes"] = sum(
            v._local_tensor.numel() * 4 for s in moving.optimizer.state.values() for k, v in s.items() if k != "step"
        )
        if rank == 0:
            torch.save(result, Path(out) / "offload.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_offload_onload_through_reused_buffers_keeps_training_exact(qwen3_dir, tmp_path):
    model_dir = make_tiny_model(tmp_path / "model", "qwen3", seed=0)
    mp.start_processes(
        _offload_worker, args=(free_port(), str(model_dir), str(tmp_path)), nprocs=2, start_method=start_method()
    )
    result = torch.load(tmp_path / "offload.pt")
    for name, tensor in result["staying"].items():  # offload + onload between steps changed nothing
        assert torch.equal(result["moving"][name], tensor), name
    moved = result["local_bytes"] + result["optim_bytes"]
    for step, (offloaded, onloaded) in enumerate(result["moves"]):
        assert offloaded["bytes"] == onloaded["bytes"] == moved
        assert offloaded["host_allocations"] == (0 if step else len(result["ptrs"][0]) + 2 * len(result["ptrs"][0]))
    assert result["ptrs"][1] == result["ptrs"][2]  # the offloaded parameters sat in the same host buffers


# ---- accounting and config ------------------------------------------------------------------------


def test_engine_release_answers_count_freed_bytes():
    gpu_rank = {"before": {"weight_bytes": 100, "allocated": 900}, "after": {"weight_bytes": 0, "allocated": 200}}
    cpu_rank = {"before": {"weight_bytes": 80}, "after": {"weight_bytes": 0}}
    answers = [{"memory": [gpu_rank, gpu_rank]}, {"memory": [cpu_rank]}, {"success": True}]  # the last: SGLang
    assert freed_bytes(answers) == 700 + 700 + 80


def test_sleep_wake_rate_and_its_ceiling_for_the_same_bytes():
    moves = {
        "trainer_onload_bytes": 4e9,
        "trainer_onload_seconds": 0.2,
        "trainer_offload_bytes": 4e9,
        "trainer_offload_seconds": 0.3,
    }
    figures = sleep_wake_figures(moves, {"h2d_gbps": 40.0, "d2h_gbps": 20.0})
    assert figures["sleep_wake_bytes"] == 8e9 and figures["sleep_wake_gbps"] == pytest.approx(16.0)
    assert figures["sleep_wake_ceiling_gbps"] == pytest.approx(8 / (4 / 40 + 4 / 20))  # 0.1 s + 0.2 s
    cpu = sleep_wake_figures({"trainer_onload_bytes": 0, "trainer_offload_bytes": 0}, None)
    assert cpu["sleep_wake_gbps"] is None and cpu["sleep_wake_ceiling_gbps"] is None
    assert cpu["engine_graph_captures"] is None  # no colocated turn measured them


def test_the_end_of_a_turn_reports_the_trainer_memory_given_back(qwen3_dir, gloo_world_of_one):
    """CPU: nothing to move and no cache to give back, but the trainer's offload runs the give-back and
    says so (None figures); a GPU's figures reach the step's metrics and its console line."""
    from rollfleet.train.fsdp import PolicyTrainer, TrainConfig

    answer = PolicyTrainer(qwen3_dir, TrainConfig()).offload()
    assert answer["bytes"] == 0 and answer["memory"] == dict.fromkeys(TRAINER_MEMORY)
    cpu = sleep_wake_figures({"trainer_memory": answer["memory"]})
    assert cpu["trainer_reserved_after_bytes"] is None and "trainer reserved" not in _moves_text(cpu)
    gib = 2**30
    gpu = {"allocated_before": 40 * gib, "reserved_before": 108 * gib, "allocated_after": 0, "reserved_after": gib}
    figures = sleep_wake_figures({"trainer_memory": gpu})
    assert figures["trainer_reserved_before_bytes"] == 108 * gib and figures["trainer_allocated_after_bytes"] == 0
    assert "trainer reserved 108.0 -> 1.0 GiB" in _moves_text(figures)


def test_the_graphs_a_colocated_turn_makes_the_engines_capture_again_are_printed():
    moves = {"trainer_onload_bytes": 1e9, "trainer_onload_seconds": 0.1, "engine_graph_captures": 3}
    figures = sleep_wake_figures({**moves, "engine_graph_capture_seconds": 0.5}, None)
    assert (figures["engine_graph_captures"], figures["engine_graph_capture_seconds"]) == (3, 0.5)
    assert "graphs recaptured 3 in 0.50s" in _moves_text(figures)
    assert "graphs recaptured" not in _moves_text({**figures, "engine_graph_captures": 0})


@pytest.mark.parametrize("engines, every, expected", [(1, None, 1), (2, None, 0), (3, "auto", 0), (2, 5, 5), (1, 0, 0)])
def test_auto_snapshots_only_a_single_engine_fleet(engines, every, expected):
    overrides = ["rollout.model_path=m", f"rollout.num_engines={engines}"]
    if every is not None:
        overrides.append(f"grpo.recovery_checkpoint_every={every}")
    assert load_config(None, overrides).recovery_snapshot_every == expected


@pytest.mark.parametrize("bad", ["always", "-1", "true", "1.5"])
def test_bad_snapshot_interval_names_field_value_and_fix(bad):
    with pytest.raises(ConfigError) as err:
        load_config(None, ["rollout.model_path=m", f"grpo.recovery_checkpoint_every={bad}"])
    message = str(err.value)
    assert "grpo.recovery_checkpoint_every=" in message and "fix: use auto" in message
