"""Waiting in tests: on an observable the code exposes (a state, a lifecycle history and its
reasons, scheduler stats, a gate's phase), with a deadline for a stuck run and a check that what
the wait is about is still alive, so a wait fails at once, saying why, instead of at its deadline.
Every deadline sits below pytest-timeout (300 s a test), and a wait that fails prints the state it
waited on (`state`): a failure is a diagnosis, not a timeout."""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable
from typing import Any

LONGEST_WAIT_S = 240.0  # below pytest-timeout, so a stuck wait fails with its state, not pytest's dump


def chaos_rng() -> random.Random:
    """The random choices of a chaos test (which engine a fault hits, at which step of a generate):
    seed 0, or ROLLFLEET_CHAOS_SEED (`make test-stress` varies it from round to round)."""
    return random.Random(int(os.environ.get("ROLLFLEET_CHAOS_SEED", "0")))


class WaitTimedOut(AssertionError):
    """A wait passed its deadline: the run was stuck or slow, which says nothing of the claim under
    test (the mutation check does not count it as a kill)."""


def wait_until(
    condition: Callable[[], Any],
    *,
    what: str,
    timeout: float = 60.0,
    alive: Callable[[], bool] | None = None,
    interval: float = 0.02,
    state: Callable[[], Any] | None = None,
) -> Any:
    """`condition()`'s first true value. Fails when `alive()` (the thread, process or engine the
    condition is about) turns false first, or after `timeout` s: a deadline far above any
    legitimate wait on a loaded machine, not a claim about speed. The failure names `what` and, with
    `state`, what `state()` says then (each engine's state, version, outstanding requests...)."""
    assert timeout <= LONGEST_WAIT_S, f"{what}: a deadline of {timeout} s would outlast pytest-timeout"
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if alive is not None and not alive():
            raise AssertionError(f"{what}: what the wait is about ended first{_said(state)}")
        if time.monotonic() >= deadline:
            raise WaitTimedOut(f"{what}: not within {timeout} s{_said(state)}")
        time.sleep(interval)


def _said(state: Callable[[], Any] | None) -> str:
    if state is None:
        return ""
    try:
        return f"; state then: {state()}"
    except Exception as exc:  # noqa: BLE001 - the diagnosis must not hide the failure it explains
        return f"; state unreadable: {exc!r}"


def fleet_state(fleet) -> list[tuple]:
    """Each slot's id, state, version, outstanding requests and last three transitions: what a failed
    wait on a fleet prints."""
    return [
        (
            s.engine_id,
            s.state.value,
            s.version,
            s.outstanding,
            [(t.new.value, t.why[:80]) for t in s.lifecycle.history[-3:]],
        )
        for s in fleet.slots
    ]
