"""prompt_handoffs: the process's GIL switch interval is short while any push runs, and what it was after."""

from __future__ import annotations

import sys
import threading

import pytest

from rollfleet.wire.handoffs import PUSH_SWITCH_INTERVAL_S, prompt_handoffs


@pytest.fixture
def interval():
    saved = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    yield
    sys.setswitchinterval(saved)


def test_short_inside_nested_and_overlapping_blocks_and_restored_after_the_last(interval):
    entered, leave = threading.Event(), threading.Event()

    def other_push():
        with prompt_handoffs():
            entered.set()
            leave.wait()

    with prompt_handoffs():
        assert sys.getswitchinterval() == pytest.approx(PUSH_SWITCH_INTERVAL_S, abs=2e-6)
        thread = threading.Thread(target=other_push)
        thread.start()
        entered.wait()
        with prompt_handoffs():
            assert sys.getswitchinterval() == pytest.approx(PUSH_SWITCH_INTERVAL_S, abs=2e-6)
    assert sys.getswitchinterval() == pytest.approx(PUSH_SWITCH_INTERVAL_S, abs=2e-6)  # the other push still runs
    leave.set()
    thread.join()
    assert sys.getswitchinterval() == pytest.approx(0.005, abs=2e-6)


def test_restored_after_an_error_and_never_longer_than_what_the_process_set(interval):
    with pytest.raises(RuntimeError), prompt_handoffs():
        raise RuntimeError("a push failed")
    assert sys.getswitchinterval() == pytest.approx(0.005, abs=2e-6)
    sys.setswitchinterval(PUSH_SWITCH_INTERVAL_S / 2)
    with prompt_handoffs():
        assert sys.getswitchinterval() == pytest.approx(PUSH_SWITCH_INTERVAL_S / 2, abs=2e-6)
    assert sys.getswitchinterval() == pytest.approx(PUSH_SWITCH_INTERVAL_S / 2, abs=2e-6)
