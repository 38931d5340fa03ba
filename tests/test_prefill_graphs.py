"""The padded layout of small prefill steps (rollfleet/engine/kv/prefill_graphs.py), which their CUDA
graphs capture: the same forward, fed eagerly on the CPU, gives each row the logits of the packed
step, and writes the same keys and values into the row's pages (a decode step after it reads them)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from rollfleet.engine.kv.blocks import TRASH_PAGE, BlockPool
from rollfleet.engine.kv.graphs import batch_buckets
from rollfleet.engine.kv.paged import PagedModel
from rollfleet.engine.kv.prefill_graphs import (
    PREFILL_GRAPH_TOKENS,
    last_token_rows,
    padded_host,
    padded_inputs,
    padded_shape,
)
from rollfleet.engine.kv.setup import paged_options
from rollfleet.engine.process.server_args import build_parser
from rollfleet.tiny_models import tiny_config


class _NoAdapter:
    def use(self, name):
        assert name is None


@pytest.fixture
def paged():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a fleet engine's: a row's logits then do not depend on the rows beside it
    try:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tiny_config("qwen3")).eval()
        paged = PagedModel(model, _NoAdapter(), None, tp_size=1, device=torch.device("cpu"), page_size=4, graphs=False)
        paged.allocate(num_pages=120, max_graph_batch=0)
        for tensor in [*paged.pool.keys, *paged.pool.values]:
            tensor.fill_(float("nan"))  # what a resume under the memory saver may leave: must not reach a row
        yield paged, BlockPool(120, 4)
    finally:
        torch.set_num_threads(threads)


def _padded_step(paged, rows, logits_at):
    shape = padded_shape(rows, batch_buckets(64))
    picked = last_token_rows(rows, logits_at)
    ids, positions, inputs, keep = padded_inputs(padded_host(rows, shape, paged.page_size), shape, paged.pool)
    with torch.inference_mode():
        return paged._forward(ids, positions, inputs, keep)[picked]


def test_the_padded_layout_gives_each_row_the_packed_steps_logits_and_kv(paged):
    model, blocks = paged
    prompts = [list(range(3, 16)), [40, 41, 42], list(range(50, 57)), [9, 10]]
    # one cached prefix (its first 8 tokens already in its pages), rows of different lengths, 3 rows in a bucket of 4
    packed_pages, padded_pages = ([blocks.allocate(5) for _ in prompts] for _ in range(2))
    for pages in (packed_pages[0], padded_pages[0]):
        model.step([(0, prompts[0][:8], pages)], logits_at=[7])
    rows = [(8, prompts[0][8:], packed_pages[0]), *[(0, p, pg) for p, pg in zip(prompts[1:3], packed_pages[1:3])]]
    ends = torch.tensor([len(t) for _, t, _ in rows]).cumsum(0) - 1
    want = model.step(rows, logits_at=ends.tolist())
    padded_rows = [(start, tokens, new) for (start, tokens, _), new in zip(rows, padded_pages)]
    got = _padded_step(model, padded_rows, ends.tolist())
    assert torch.equal(got, want)
    # the next decode step reads each row's KV as the packed step wrote it
    decode = lambda rs: [(start + len(t), [7], pages) for start, t, pages in rs]  # noqa: E731
    after = [model.step(decode(rs), logits_at=[0, 1, 2]) for rs in (padded_rows, rows)]
    assert torch.equal(*after)
    # a row alone: the padded step's padding (places in its row, the NaN pool past it) does not reach it;
    # its output head runs over one row, which the CPU rounds otherwise than the packed step's 4 (kv/cpu_rows.py)
    alone = _padded_step(model, [(0, prompts[3], padded_pages[3])], [1])
    want = model.step([(0, prompts[3], packed_pages[3])], logits_at=[1])
    assert torch.allclose(alone, want, rtol=0, atol=1e-6)


def test_which_steps_the_padded_layout_serves():
    buckets = batch_buckets(64)
    row = lambda n, pages=1: (0, [1] * n, [5] * pages)  # noqa: E731
    assert padded_shape([row(3), row(17, 5)], buckets) == (2, 32, 8)
    assert padded_shape([row(64)] * 64, buckets) == (64, 64, 4)
    assert padded_shape([row(64)] * 65, buckets) is None  # more rows than the largest bucket
    assert padded_shape([row(65)] * 64, buckets) is None  # 64 x 128 tokens: past PREFILL_GRAPH_TOKENS
    assert 64 * 64 <= PREFILL_GRAPH_TOKENS < 64 * 128
    rows = [row(3), row(4), row(2)]
    assert last_token_rows(rows, [2, 6, 8]) == [0, 1, 2]
    assert last_token_rows(rows, [6]) == [1]
    assert last_token_rows(rows, [0, 1, 2]) is None  # a prompt's input logprobs: eager
    flat = padded_host(rows, (4, 16, 8), page_size=4)
    assert flat.numel() == 3 * 4 * 16 + 2 * 4 + 4 * 8
    assert flat[-8:].tolist() == [TRASH_PAGE] * 8  # the padded row's table


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU (the GPU rounds run this file)")
def test_a_prefill_graph_replays_the_eager_steps_logits():
    """On a GPU: a shape seen once runs eagerly, the second time it is captured, then replayed with
    other tokens, lengths and pages; each time the logits are an eager engine's (float32), and the
    KV it wrote serves the next decode step alike."""
    torch.manual_seed(0)
    config = tiny_config("qwen3")
    models = [AutoModelForCausalLM.from_config(config).eval().cuda() for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    device = torch.device("cuda")
    graphed, eager = (
        PagedModel(m, _NoAdapter(), None, tp_size=1, device=device, page_size=4, graphs=graphs)
        for m, graphs in zip(models, (True, False))
    )
    for paged in (graphed, eager):
        paged.allocate(num_pages=200, max_graph_batch=16)
    blocks = BlockPool(200, 4)
    for round_, lengths in enumerate([(5, 9, 3), (5, 9, 3), (7, 2, 11), (16, 1, 4)]):
        rows = [(0, [3 + round_ + i + j for j in range(n)], blocks.allocate(5)) for i, n in enumerate(lengths)]
        ends = (torch.tensor(lengths).cumsum(0) - 1).tolist()
        got, want = graphed.step(rows, logits_at=ends), eager.step(rows, logits_at=ends)
        assert torch.allclose(got, want, rtol=0, atol=1e-4), (round_, (got - want).abs().max())
        decode = [(n, [7], pages) for n, (_, _, pages) in zip(lengths, rows)]
        got, want = graphed.step(decode, logits_at=[0, 1, 2]), eager.step(decode, logits_at=[0, 1, 2])
        assert torch.allclose(got, want, rtol=0, atol=1e-4), (round_, (got - want).abs().max())
    prefill = graphed.prefill_graphs
    assert (prefill.captures, prefill.replays, prefill.disabled) == (1, 3, None)


@pytest.mark.parametrize(
    "flags, decode, prefill",
    [([], True, True), (["--disable-prefill-cuda-graph"], True, False), (["--disable-decode-cuda-graph"], False, True)]
    + [(["--disable-cuda-graph"], False, False)],
)
def test_sglangs_graph_flags_switch_decode_and_prefill_graphs_apart(flags, decode, prefill):
    """SGLang 0.5.23's spellings: --disable-decode-cuda-graph, --disable-prefill-cuda-graph, and
    --disable-cuda-graph for both."""
    options = paged_options(build_parser().parse_args(["--model-path", "m", *flags]))
    assert (options["graphs"], options["prefill_graphs"]) == (decode, prefill)
