"""The start of the tests' own helper processes (trainer ranks over gloo, engine ranks run by hand,
weight senders): forked from one server process that imported torch, transformers and rollfleet
once for the run (multiprocessing's "forkserver"), not spawned. A spawned process imports them
again, seconds of CPU each on a 2-core machine; a forked one is still a fresh process of its own,
with none of pytest's state (the server forks before any test code runs in it). Kept apart from
conftest so that a helper's module need not import pytest's conftest and Ray."""

from __future__ import annotations

import multiprocessing

PRELOAD = [
    "torch.distributed",
    "transformers",
    "rollfleet.train.fsdp",
    "rollfleet.engine.runtime.scheduler",
    "rollfleet.weights.transports",
]


def start_method() -> str:
    """For `torch.multiprocessing.start_processes(..., start_method=start_method())`."""
    multiprocessing.set_forkserver_preload(PRELOAD)  # read when the server first starts
    return "forkserver"


def context():
    """For processes, queues and pipes made by hand: `context().Process(...)`."""
    return multiprocessing.get_context(start_method())
