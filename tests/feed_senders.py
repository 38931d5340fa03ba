"""Two sender processes (a gloo group) kept for a test module, for tests/test_feed.py.

Starting a sender costs more than a push (it joins the group and loads the model; spawned, it also
imported torch and transformers: tens of seconds on a shared 2-core machine), so the ranks are
started once (forked: helper_processes) and each test hands them a list of pushes. This module is
kept apart from the test module so that the processes import only what a sender needs (not
pytest's conftest and Ray)."""

from __future__ import annotations

import contextlib
import os
import queue
import time

import helper_processes
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from rollfleet.config import TensorSync
from rollfleet.weights.source import ModuleSource
from rollfleet.weights.transports.feed import RankFeed
from rollfleet.weights.transports.tensor import TensorTransport
from rollfleet.wire.net import free_port

WORLD = 2
FEEDERS = {0: (0,), 1: (1,), 2: (0, 1)}  # engine 2 (tp=2): its tp rank 1 reads rank 1's buffer


class BrokenOnRank:
    """A source that raises on one rank only, after some tensors (the others' sources are fine)."""

    def __init__(self, model, rank: int, broken_rank: int):
        self.inner, self.rank, self.broken_rank = ModuleSource(model), rank, broken_rank

    def named_tensors(self):
        for count, item in enumerate(self.inner.named_tensors()):
            if self.rank == self.broken_rank and count == 8:
                raise OSError("the disk under this rank's source went away")
            yield item


class LastLayerWrong:
    """Every rank sends the same tensor of a wrong shape in the last decoder layer: a late call is refused."""

    def __init__(self, model, rank: int):
        self.inner = ModuleSource(model)

    def named_tensors(self):
        for name, tensor in self.inner.named_tensors():
            yield (name, tensor[:-1]) if name.endswith("layers.1.mlp.down_proj.weight") else (name, tensor)


SOURCES = {
    "good": lambda model, rank: ModuleSource(model),
    "refused": LastLayerWrong,
    "broken": lambda model, rank: BrokenOnRank(model, rank, broken_rank=1),
}


def sender_rank(rank, port, targets, commands, results):
    """One sender process: joins the gloo group, then for each command (model dir, [(source kind,
    version)]) pushes them in order with one newly connected transport and puts (rank, pid,
    [(outcome, report or error, seconds, each engine's weight version after it)]); None ends it."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    group, models = RankFeed.new_group(120), {}
    for model_dir, pushes in iter(commands.get, None):
        if model_dir not in models:
            models[model_dir] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        feed = RankFeed(rank, WORLD, FEEDERS, group, {"sender": f"process {rank}"})
        transport = TensorTransport(TensorSync(bucket_mb=0.1), targets, feed=feed, timeout_s=60)
        outcomes = [_push(transport, SOURCES[kind](models[model_dir], rank), version) for kind, version in pushes]
        transport.disconnect()
        results.put((rank, os.getpid(), outcomes))
    dist.destroy_process_group()
    # the parent has read every answer, so nothing is left to flush; skipping the interpreter's
    # tear-down of torch, gloo and the engine pool saves seconds to tens of seconds per rank
    os._exit(0)


def _push(transport, source, version) -> tuple:
    start = time.monotonic()
    try:
        outcome = ("ok", transport.send(source, version))
    except Exception as exc:  # noqa: BLE001  (the test reads it)
        outcome = ("error", f"{type(exc).__name__}: {exc}")
    held = [transport.pool.call(t.engine_id, "get_model_info")["weight_version"] for t in transport.targets]
    return (*outcome, time.monotonic() - start, held)


class SenderRanks:
    """WORLD sender processes started once; `push` runs a list of pushes on every rank together."""

    def __init__(self, targets):
        context = helper_processes.context()
        self.results, port = context.Queue(), free_port()
        self.commands = [context.Queue() for _ in range(WORLD)]
        self.procs = [
            context.Process(target=sender_rank, args=(rank, port, targets, self.commands[rank], self.results))
            for rank in range(WORLD)
        ]
        for proc in self.procs:
            proc.start()

    def push(self, model_dir: str, pushes: list[tuple[str, str]], timeout: float = 300) -> dict:
        """Every rank's (pid, outcomes), by rank; fails if a rank does not answer within `timeout`
        (the first command's answer includes the processes' start)."""
        for commands in self.commands:
            commands.put((model_dir, pushes))
        answers, deadline = {}, time.monotonic() + timeout
        while len(answers) < WORLD:
            dead = [f"rank {r}: exit code {p.exitcode}" for r, p in enumerate(self.procs) if not p.is_alive()]
            assert not dead, f"sender processes died: {dead} (their traceback is above)"
            assert time.monotonic() < deadline, (
                f"ranks {set(range(WORLD)) - set(answers)} did not answer in {timeout} s"
            )
            with contextlib.suppress(queue.Empty):
                rank, pid, outcomes = self.results.get(timeout=0.2)
                answers[rank] = (pid, outcomes)
        return answers

    def close(self) -> None:
        for commands in self.commands:
            commands.put(None)
        # is_alive() asks waitpid; join() would wait on the process's sentinel pipe, which a child the
        # rank started keeps open after the rank itself exited (30 s per rank until join's timeout)
        deadline = time.monotonic() + 30
        while any(proc.is_alive() for proc in self.procs) and time.monotonic() < deadline:
            time.sleep(0.05)
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
