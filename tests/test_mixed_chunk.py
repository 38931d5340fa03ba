"""`--enable-mixed-chunk` (kv/steps.py `_riders`): decode rows ride along a prefill step instead of
waiting for it, on a real paged forward of a tiny model: while a long prompt joins in chunks, the
rows already decoding gain a token every step, and every row's greedy tokens are a plain forward's."""

from __future__ import annotations

import pytest
import torch
from test_overlap import PAGED, PAGES, one_thread  # noqa: F401  (the fixture, autouse there)
from transformers import AutoModelForCausalLM

from rollfleet.engine.kv.blocks import BlockPool
from rollfleet.engine.kv.steps import PagedBatches
from rollfleet.engine.sequences.logprobs import LogprobAsk
from rollfleet.engine.sequences.next_token import StopRules
from rollfleet.engine.sequences.sampling import Sampler
from rollfleet.engine.sequences.sequence import sample_group
from rollfleet.engine.tp.lockstep import Action
from rollfleet.tiny_models import tiny_config
from rollfleet.wire.protocol import SamplingParams

SHORT = [[5, 6, 7], [9, 10, 11, 12]]
LONG = list(range(40, 60))  # 20 tokens: chunks of 8, 8 and 4


def _plain_greedy(prompt: list[int], tokens: int) -> list[int]:
    torch.manual_seed(0)  # the weights of test_overlap's PAGED model
    model = AutoModelForCausalLM.from_config(tiny_config("qwen3")).eval()
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(tokens):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def _run(mixed: bool) -> tuple[list[list[int]], list[list[int]]]:
    """Two short prompts decode; after two steps the long one joins. Returns every step's fed counts
    and the three outputs."""
    fed = []

    def lockstep(action, **kwargs):
        if action is Action.STEP:
            fed.append([len(tokens) for _, tokens, _ in kwargs["rows"]])
            return PAGED.step(**kwargs)
        return None

    batches = PagedBatches(
        BlockPool(PAGES, 4),
        lockstep=lockstep,
        sampler=Sampler(seed=0),
        stops=StopRules(frozenset(), 512, None),
        read_routes=lambda: None,
        kv_epoch=lambda: PAGED.epoch,
        weights_generation=lambda: 0,
        adapter_identity=lambda name: "base",
        chunk_tokens=8,
        mixed=mixed,
    )
    params = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
    running = [sample_group(p, params, f"s{i}", True, None, LogprobAsk())[0] for i, p in enumerate(SHORT)]
    seqs = [*running, sample_group(LONG, params, "long", True, None, LogprobAsk())[0]]
    for step in range(40):
        if step == 3:  # the short ones' prefill, then two decode steps
            running.append(seqs[2])
        batches.advance(running, recompute=False, lora_name=None)
        running = [seq for seq in running if seq.finish is None]
        if not running:
            return fed, [seq.output_ids for seq in seqs]
    pytest.fail("rows stopped making progress")


@pytest.mark.parametrize("mixed", [True, False])
def test_decode_rows_ride_along_the_chunks_of_a_joining_prompt(mixed):
    fed, outputs = _run(mixed)
    assert outputs == [_plain_greedy(prompt, 8) for prompt in [*SHORT, LONG]]
    chunks = fed[3:6]
    if mixed:  # each chunk of the long prompt, and a token of each short row beside it
        assert chunks == [[8, 1, 1], [8, 1, 1], [4, 1, 1]]
    else:  # the short rows wait for the three chunks
        assert chunks == [[8], [8], [4]]
