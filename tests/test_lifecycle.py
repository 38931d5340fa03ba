"""The engine lifecycle's rules, and the restart backoff read from its history."""

from __future__ import annotations

import pytest

from rollfleet.fleet.lifecycle import EngineState, IllegalTransition, Lifecycle, backoff_s

S = EngineState


def test_only_listed_transitions_happen_and_a_recovered_engine_says_so():
    life = Lifecycle(3)
    with pytest.raises(IllegalTransition, match="engine 3: STARTING -> RECOVERING"):
        life.to(S.RECOVERING, "no")
    for state in (S.ACTIVE, S.INACTIVE, S.RECOVERING, S.AWAITING_WEIGHTS, S.ACTIVE):
        life.to(state, "step")
    assert life.history[-1].why == "recovered: step" and not life.restarted_since_active


def test_restarts_count_the_tries_since_the_engine_last_served():
    life = Lifecycle(0)
    life.to(S.ACTIVE, "up")
    assert life.restarts_since_active() == (0, 0.0)
    life.to(S.INACTIVE, "killed")
    died = life.history[-1].time
    assert life.restarts_since_active() == (0, died)  # its first restart is due at once
    life.to(S.RECOVERING, "restart")
    life.to(S.INACTIVE, "restart failed")
    life.to(S.RECOVERING, "restart")
    life.to(S.AWAITING_WEIGHTS, "restarted")
    life.to(S.INACTIVE, "hung while restored")  # up, but never served: still a failed try
    tries, last_down = life.restarts_since_active()
    assert tries == 2 and last_down == life.history[-1].time >= died
    life.to(S.RECOVERING, "restart")
    life.to(S.AWAITING_WEIGHTS, "restarted")
    life.to(S.ACTIVE, "verified")
    assert life.restarts_since_active()[0] == 0


@pytest.mark.parametrize(
    "tries, base, cap, wait",
    [(0, 2.0, 120.0, 0.0), (1, 2.0, 120.0, 2.0), (2, 2.0, 120.0, 4.0), (4, 2.0, 120.0, 16.0), (9, 2.0, 120.0, 120.0)]
    + [(3, 0.0, 120.0, 0.0), (3, 5.0, 1.0, 1.0)],
)
def test_backoff_doubles_per_try_up_to_its_cap(tries, base, cap, wait):
    assert backoff_s(tries, base, cap) == wait
