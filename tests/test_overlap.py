"""The overlapped decode step (rollfleet/engine/kv/overlap.py) on a real paged forward of a tiny model:
steps launched before the host has read the last one record what steps that wait record (tokens,
logprobs, top-k, finishes), run no step more for rows that end by length, give every page back,
and stay right when a row appears that the step in flight does not hold or the step is thrown away."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from rollfleet.engine.kv.blocks import BlockPool
from rollfleet.engine.kv.paged import PagedModel
from rollfleet.engine.kv.steps import PagedBatches, StepOutcome
from rollfleet.engine.sequences.logprobs import LogprobAsk
from rollfleet.engine.sequences.next_token import StopRules
from rollfleet.engine.sequences.sampling import Sampler
from rollfleet.engine.sequences.sequence import sample_group
from rollfleet.engine.tp.lockstep import Action
from rollfleet.tiny_models import tiny_config
from rollfleet.wire.protocol import SamplingParams

PAGES = 80


class _NoAdapter:
    def use(self, name):
        assert name is None


def _paged() -> PagedModel:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("qwen3")).eval()
    paged = PagedModel(model, _NoAdapter(), None, tp_size=1, device=torch.device("cpu"), page_size=4, graphs=False)
    paged.allocate(num_pages=PAGES, max_graph_batch=0)
    return paged


PAGED = _paged()


@pytest.fixture(autouse=True)
def one_thread():
    """As a fleet engine runs on a CPU (kv/paged.py): a row's logits then do not depend on the rows
    beside it, and a finished row that rides one step more (a stop seen one step late) changes no
    other row's bits."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _batches(overlap: bool, launched: list[int] | None = None) -> PagedBatches:
    def lockstep(action, **kwargs):
        if action is Action.STEP:
            if launched is not None:
                launched.append(len(kwargs["rows"]))
            return PAGED.step(**kwargs)
        return None

    return PagedBatches(
        BlockPool(PAGES, 4),
        lockstep=lockstep,
        sampler=Sampler(seed=0),
        stops=StopRules(frozenset({0}), 512, None),
        read_routes=lambda: None,
        kv_epoch=lambda: PAGED.epoch,
        weights_generation=lambda: 0,
        adapter_identity=lambda name: "base",
        chunk_tokens=None,
        overlap=overlap,
    )


def _requests(stop_token: int | None = None):
    """Greedy and seeded rows of several lengths, one with top-k logprobs (the general sampling
    path), one banning its stop ids for a while, one that may stop on `stop_token`."""
    seeded = {"temperature": 1.0, "sampling_seed": 7, "ignore_eos": True}
    greedy = {"temperature": 0.0, "ignore_eos": True}
    asks = [
        ([5, 6, 7, 8, 9], SamplingParams(max_new_tokens=9, n=2, **seeded), LogprobAsk()),
        ([11, 12, 13], SamplingParams(max_new_tokens=4, **greedy), LogprobAsk(top_n=3)),
        ([20, 21], SamplingParams(max_new_tokens=12, stop_token_ids=[stop_token] if stop_token else None, **greedy),
         LogprobAsk()),
        ([30, 31, 32, 33, 34, 35, 36], SamplingParams(max_new_tokens=7, min_new_tokens=5, temperature=1.0,
                                                      sampling_seed=3, stop_token_ids=[1, 2]), LogprobAsk()),
    ]  # fmt: skip
    seqs = []
    for i, (prompt, params, ask) in enumerate(asks):
        seqs += sample_group(prompt, params, f"r{i}", True, None, ask)
    return seqs


def _run(batches: PagedBatches, seqs, join_at: int | None = None, joiner=None):
    """A scheduler's loop: steps (overlapped where the batches may), finished rows retire, then the
    step still in flight is settled. `joiner` joins at step `join_at` without a settle first."""
    running, steps = list(seqs), 0
    while running:
        assert steps < 100, "rows stopped making progress"  # no request here needs more than 13 steps
        if join_at is not None and steps == join_at:
            running.append(joiner)
        outcome = batches.advance(running, recompute=False, lora_name=None, overlap=True)
        steps += 1
        keep = [row for row, seq in enumerate(running) if seq.finish is None]
        if len(keep) < len(running):
            batches.retire(running, keep)
            running = [running[row] for row in keep]
        assert not outcome.preempted
    batches.settle(StepOutcome())
    return [(s.output_ids, s.logprobs, s.record.output_top, s.finish) for s in seqs]


def test_overlapped_steps_record_what_waiting_steps_record_and_give_every_page_back():
    plain = _run(_batches(False), _requests())
    stop_token = plain[3][0][4]  # the stop-token row's fifth greedy token: it stops there
    plain = _run(_batches(False), seqs := _requests(stop_token))
    assert seqs[3].finish.type == "stop" and len(seqs[3].output_ids) == 5
    overlapped = _batches(True)
    assert _run(overlapped, _requests(stop_token)) == plain
    overlapped.flush()
    assert overlapped.blocks.available == overlapped.blocks.usable  # nothing held by the rows thrown away
    assert overlapped.inflight is None


def test_a_batch_that_ends_by_length_runs_no_step_more_than_waiting_steps():
    def requests():
        params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True, n=3)
        return sample_group([4, 5, 6], params, "r", True, None, LogprobAsk())

    waited, flew = [], []
    assert _run(_batches(False, waited), requests()) == _run(_batches(True, flew), requests())
    assert flew == waited == [1, 3, 3, 3, 3, 3]  # the prompt's prefill, then five decode steps of 3 rows


def test_a_row_the_step_in_flight_does_not_hold_waits_for_it_to_be_recorded():
    """A joiner is settled for by the scheduler (runtime/overlapping.py); without it, the next step
    must not launch fed with draws the new row has none of."""
    joiner = dict(prompt_ids=[40, 41, 42], params=SamplingParams(max_new_tokens=5, temperature=0.0))

    def run(overlap: bool):
        seqs = _requests()
        late = sample_group(joiner["prompt_ids"], joiner["params"], "late", True, None, LogprobAsk())[0]
        return _run(_batches(overlap), seqs, join_at=3, joiner=late), late.output_ids

    assert run(True) == run(False)


def test_a_step_thrown_away_unread_leaves_its_rows_to_decode_again():
    """A failed batch's `drop` throws the step in flight away: rows that keep their pages feed
    their newest token again and go on as if that step never ran."""
    want = _run(_batches(False), _requests())
    batches, seqs = _batches(True), _requests()
    for _ in range(3):
        batches.advance(seqs, recompute=False, lora_name=None, overlap=True)
    assert batches.inflight is not None
    batches.drop([])
    assert batches.inflight is None
    assert _run(batches, [s for s in seqs if s.finish is None]) is not None
    assert [(s.output_ids, s.logprobs, s.record.output_top, s.finish) for s in seqs] == want
