"""Waiting in tests: on an observable the code exposes (a state, a lifecycle history and its
reasons, scheduler stats, a gate's phase), with a deadline for a stuck run and a check that what
the wait is about is still alive, so a wait fails at once, saying why, instead of at its deadline."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


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
) -> Any:
    """`condition()`'s first true value. Fails when `alive()` (the thread, process or engine the
    condition is about) turns false first, or after `timeout` s: a deadline far above any
    legitimate wait on a loaded machine, not a claim about speed."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        assert alive is None or alive(), f"{what}: what the wait is about ended first"
        if time.monotonic() >= deadline:
            raise WaitTimedOut(f"{what}: not within {timeout} s")
        time.sleep(interval)
