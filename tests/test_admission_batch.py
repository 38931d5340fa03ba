"""Which waiting requests run (admission_batch.py), as pure functions of the queue."""

from __future__ import annotations

from collections import deque

from hypothesis import given
from hypothesis import strategies as st

from rollfleet.engine.sequences.admission_batch import joiners, new_batch
from rollfleet.engine.sequences.sequence import Sequence
from rollfleet.wire.protocol import SamplingParams


def seq(i: int, lora: str | None = None, prompt: int = 4, output: int = 0) -> Sequence:
    s = Sequence(f"r{i}", list(range(prompt)), SamplingParams(), None, return_logprob=False, lora_name=lora)
    s.output_ids = [1] * output
    return s


queues = st.lists(st.tuples(st.sampled_from([None, "a", "b"]), st.integers(1, 9)), min_size=1, max_size=12)


@given(queue=queues, max_running=st.integers(1, 6))
def test_a_new_batch_takes_the_oldest_requests_adapter_in_order_up_to_the_limit(queue, max_running):
    waiting = deque(seq(i, lora, prompt) for i, (lora, prompt) in enumerate(queue))
    lora, batch, left = new_batch(waiting, max_running)
    assert lora == queue[0][0]
    assert batch == [s for s in waiting if s.lora_name == lora][:max_running]
    assert list(left) == [s for s in waiting if s not in batch]  # nobody lost, nobody twice, order kept


@given(queue=queues, running=st.integers(1, 6), made=st.integers(0, 20), max_running=st.integers(1, 8))
def test_requests_join_a_young_batch_of_their_adapter_with_room(queue, running, made, max_running):
    batch = [seq(100 + i, "a", output=made) for i in range(running)]
    waiting = deque(seq(i, lora, prompt) for i, (lora, prompt) in enumerate(queue))
    joining = joiners(batch, waiting, "a", max_running)
    same = [s for s in waiting if s.lora_name == "a"][: max(max_running - running, 0)]
    cheap = running * made <= sum(len(s.prompt_ids) for s in same)
    assert joining == (same if same and cheap else [])


def test_a_late_request_waits_instead_of_making_a_long_batch_recompute():
    batch = [seq(0, output=50)]
    assert joiners(batch, deque([seq(1, prompt=10)]), None, 8) == []
    assert joiners(batch, deque([seq(1, prompt=60)]), None, 8) != []
    assert joiners(batch, deque([seq(1, prompt=60)]), None, 1) == []  # no room
