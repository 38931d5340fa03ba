"""The paged KV path (rollfleet/engine/kv/): its attention against transformers' own forward, and on
real servers the same greedy tokens as a plain forward through everything that moves KV around:
chunked prefills, requests joining a running set, the n samples of a prompt sharing its prefill,
prefix-cache hits, and preemption when the pool runs out."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch
from conftest import call, client_for, engine_servers, held_in_flight, reference_greedy, run, scheduler_stats_when
from transformers import AutoModelForCausalLM

from rollfleet.engine.kv.blocks import BlockPool
from rollfleet.engine.kv.paged import PagedModel
from rollfleet.tiny_models import tiny_config

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22], [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42]]


class _NoAdapter:
    def use(self, name):
        assert name is None


@pytest.mark.parametrize("kind, pool_holds", [("qwen3", 0.0), ("qwen3_moe", 0.0), ("qwen3", float("nan"))])
def test_chunked_prefill_fork_and_decode_match_a_full_forward(kind, pool_holds):
    """`pool_holds`: what every slot holds before the first step. NaN stands for the arbitrary bits a
    resume under the memory saver leaves (kv/pool.py): the slots read past a row's length (the rest
    of its last page, padding pages) must not reach the logits."""
    torch.manual_seed(0)
    config = tiny_config(kind)
    reference = AutoModelForCausalLM.from_config(copy.deepcopy(config)).eval()
    model = AutoModelForCausalLM.from_config(config).eval()
    model.load_state_dict(reference.state_dict())
    paged = PagedModel(model, _NoAdapter(), None, tp_size=1, device=torch.device("cpu"), page_size=4, graphs=False)
    paged.allocate(num_pages=40, max_graph_batch=0)
    for tensor in [*paged.pool.keys, *paged.pool.values]:
        tensor.fill_(pool_holds)
    blocks = BlockPool(40, 4)
    pages = [blocks.allocate(blocks.pages_for(len(p) + 4)) for p in PROMPTS]
    paged.step([(0, p[:3], pg) for p, pg in zip(PROMPTS, pages)], logits_at=[0])  # a first chunk of each
    rows = [(3, p[3:], pg) for p, pg in zip(PROMPTS, pages)]
    ends = torch.tensor([len(p) - 3 for p in PROMPTS]).cumsum(0) - 1
    logits = paged.step(rows, logits_at=ends.tolist())
    # a fork of the last prompt: its full pages shared, its partial last page copied
    fork = [*pages[2][:3], blocks.allocate(1)[0]]
    seqs = [list(p) for p in [*PROMPTS, PROMPTS[2]]]
    tokens = [*logits.argmax(-1).tolist(), logits[2].argmax().item()]
    copies = [(pages[2][3], fork[3])]
    for _ in range(3):
        for seq, token in zip(seqs, tokens):
            seq.append(token)
        rows = [(len(s) - 1, [s[-1]], pg) for s, pg in zip(seqs, [*pages, fork])]
        logits = paged.step(rows, logits_at=[0, 1, 2, 3], copies=copies)
        copies, tokens = [], logits.argmax(-1).tolist()
    with torch.inference_mode():
        for row, seq in enumerate(seqs):
            want = reference(torch.tensor([seq])).logits[0, -1]
            assert torch.allclose(logits[row], want, atol=1e-5), (kind, row, (logits[row] - want).abs().max())


@pytest.fixture
def one_thread_paged():
    """A tiny Qwen3 on the paged pool (80 pages of 4), run as a fleet engine runs on a CPU: one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tiny_config("qwen3")).eval()
        paged = PagedModel(model, _NoAdapter(), None, tp_size=1, device=torch.device("cpu"), page_size=4, graphs=False)
        paged.allocate(num_pages=80, max_graph_batch=0)
        yield paged, BlockPool(80, 4)
    finally:
        torch.set_num_threads(threads)


def test_a_rows_logits_on_cpu_do_not_depend_on_how_many_rows_share_its_step(one_thread_paged):
    """One thread (a fleet engine's): a prompt prefilled alone or among others, and one decode row
    alone or among others, get bit-equal logits. Without the padding (kv/cpu_rows.py), MKL's
    products over few rows round otherwise, and a seeded run's logprobs, then its weights, drift
    with how arrival waves split."""
    paged, blocks = one_thread_paged
    mine, others = [3, 4, 5], [[40 + i, 41 + i, 42 + i] for i in range(5)]

    def prefill(prompts):  # each prompt's last-token logits
        rows = [(0, p, blocks.allocate(2)) for p in prompts]
        ends = torch.tensor([len(p) for p in prompts]).cumsum(0) - 1
        return paged.step(rows, logits_at=ends.tolist()), rows

    alone, (row,) = prefill([mine])
    shared, rows = prefill([mine, *others])
    assert torch.equal(alone[0], shared[0])
    decode = [(3, [7], pages) for _, _, pages in [row, *rows[1:]]]
    assert torch.equal(paged.step(decode[:1], logits_at=[0])[0], paged.step(decode, logits_at=[0, 1, 2])[0])


def test_a_rows_logits_on_cpu_do_not_depend_on_how_long_the_rows_beside_it_are(one_thread_paged):
    """One thread: a decode row and a prompt get bit-equal logits beside a row of their own length and
    beside a much longer one (a wider block table). With torch's CPU SDPA over the step's table, key
    blocks followed the widest row (1.2e-7 in the logits): one reason a seeded agent run, whose turns
    of different lengths meet in steps as their tools answer, parted from itself."""
    paged, blocks = one_thread_paged
    mine, short, long = ([5, 6, 7, 8, 9], 2), ([11, 12, 13, 14, 15], 2), (list(range(1, 61)), 16)
    pages = {}
    for name, (prompt, count) in {"mine": mine, "short": short, "long": long}.items():
        pages[name] = blocks.allocate(count)
        paged.step([(0, prompt, pages[name])], logits_at=[len(prompt) - 1])
    beside_short = paged.step([(5, [3], pages["mine"]), (5, [3], pages["short"])], logits_at=[0, 1])[0]
    beside_long = paged.step([(5, [3], pages["mine"]), (60, [3], pages["long"])], logits_at=[0, 1])[0]
    assert torch.equal(beside_short, beside_long)
    fresh = [blocks.allocate(2), blocks.allocate(2), blocks.allocate(16)]
    a = paged.step([(0, [5, 6, 7, 8], fresh[0]), (0, [1, 2, 3, 4], fresh[1])], logits_at=[3, 7])[0]
    b = paged.step([(0, [5, 6, 7, 8], fresh[0]), (0, list(range(1, 61)), fresh[2])], logits_at=[3, 63])[0]
    assert torch.equal(a, b)


def test_a_prompts_logits_on_cpu_do_not_depend_on_how_it_was_chunked_or_cached(one_thread_paged):
    """One thread: a prompt's last logits are bit-equal whether it was prefilled whole, in two chunks
    cut anywhere (a cached prefix then its rest is the same computation), or token by token, beside
    a long prompt or alone. With torch's CPU SDPA they were not (1e-7; its key and query blocks follow
    the step's widths): a seeded agent run, whose turns' prefixes were cached or not and whose prompts
    were chunked as their requests happened to meet, parted from itself (at step 71 of 150)."""
    paged, blocks = one_thread_paged
    prompt = list(range(3, 30))
    whole = paged.step([(0, prompt, blocks.allocate(7))], logits_at=[len(prompt) - 1])[0]
    for cut in (1, 4, 13, 20, 26):
        pages = blocks.allocate(7)
        paged.step([(0, prompt[:cut], pages)], logits_at=[cut - 1])
        rest = prompt[cut:]
        beside = [(0, list(range(40, 100)), blocks.allocate(15))] if cut % 2 else []
        out = paged.step([(cut, rest, pages), *beside], logits_at=[len(rest) - 1])[0]
        assert torch.equal(out, whole), cut
    pages = blocks.allocate(7)
    for position, token in enumerate(prompt):
        out = paged.step([(position, [token], pages)], logits_at=[0])[0]
    assert torch.equal(out, whole)


@pytest.fixture(scope="module")
def small_pool_servers(qwen3_dir, tmp_path_factory):
    """Pages of 4 tokens, a pool of 96 (24 pages) and prefills of at most 8 tokens a step: every
    request is chunked, and a few long ones run the pool out."""
    extra = ["--page-size", "4", "--max-total-tokens", "96", "--chunked-prefill-size", "8"]
    waits = [*extra, "--disable-overlap-schedule"]  # the same engine, its decode steps waiting for their draws
    plan = {"small": (qwen3_dir, {"extra": extra}), "waits": (qwen3_dir, {"extra": waits})}
    with engine_servers(plan, tmp_path_factory.mktemp("paged")) as procs:
        yield procs


@pytest.fixture(scope="module")
def small_pool_server(small_pool_servers):
    return small_pool_servers["small"]


def _greedy(max_new_tokens: int, **more) -> dict:
    return {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True, **more}


def _stats(server) -> dict:
    return call(server, "get_server_info")["scheduler_stats"]


def test_preemption_and_chunks_give_the_tokens_of_a_plain_forward(small_pool_server, qwen3_dir):
    prompts = [[3 + i, *range(40 + 5 * i, 52 + 5 * i)] for i in range(4)]  # 13 tokens: two chunks each
    before = _stats(small_pool_server)
    answers = call(small_pool_server, "generate", input_ids=prompts, sampling_params=_greedy(14))
    for prompt, answer in zip(prompts, answers):
        assert answer["output_ids"] == reference_greedy(qwen3_dir, prompt, 14)[0]
    after = _stats(small_pool_server)
    assert after["preempted"] > before["preempted"]  # 4 x 27 tokens do not fit in 96 at once


def test_n_samples_share_the_prompt_prefill(small_pool_server, qwen3_dir):
    prompt = PROMPTS[2]
    call(small_pool_server, "flush_cache")
    before = _stats(small_pool_server)
    answers = call(small_pool_server, "generate", input_ids=prompt, sampling_params=_greedy(5, n=3))
    want = reference_greedy(qwen3_dir, prompt, 5)[0]
    assert [a["output_ids"] for a in answers] == [want] * 3
    assert sorted(a["meta_info"]["cached_tokens"] for a in answers) == [0, len(prompt), len(prompt)]  # forked
    after = _stats(small_pool_server)
    assert after["prefill_tokens"] - before["prefill_tokens"] == len(prompt)  # not 3 x
    # the prompt's chunks of 8 (the last samples the first token of all three), then four decode steps
    chunks = -(-len(prompt) // 8)
    steps = (after["prefill_steps"] - before["prefill_steps"], after["decode_steps"] - before["decode_steps"])
    assert steps == (chunks, 4)
    assert after["prefill_seconds"] > before["prefill_seconds"] and after["decode_seconds"] > before["decode_seconds"]


def test_a_repeated_prompt_starts_from_cached_pages_until_the_cache_is_flushed(small_pool_server, qwen3_dir):
    prompt = [9, 8, 7, 6, 5, 4, 3, 2, 1, 11]  # 10 tokens: 2 full pages of 4 to reuse
    first = call(small_pool_server, "generate", input_ids=prompt, sampling_params=_greedy(3))
    again = call(small_pool_server, "generate", input_ids=prompt, sampling_params=_greedy(3))
    assert again["meta_info"]["cached_tokens"] == 8
    assert again["output_ids"] == first["output_ids"] == reference_greedy(qwen3_dir, prompt, 3)[0]
    call(small_pool_server, "flush_cache")
    flushed = call(small_pool_server, "generate", input_ids=prompt, sampling_params=_greedy(3))
    assert flushed["meta_info"]["cached_tokens"] == 0 and flushed["output_ids"] == first["output_ids"]


def test_a_request_joins_a_running_one_without_recomputing_it(small_pool_server, qwen3_dir):
    async def go():
        async with client_for(small_pool_server) as client:
            first = await held_in_flight(client, steps=4, input_ids=PROMPTS[0], sampling_params=_greedy(8))
            before = (await client.get_server_info())["scheduler_stats"]
            second = asyncio.create_task(client.generate(input_ids=PROMPTS[1], sampling_params=_greedy(8)))
            await scheduler_stats_when(client, lambda s: s["waiting_requests"] == 1, task=second)
            await client.continue_generation()  # the first has 4 tokens of 8: the second joins it
            return await first, await second, before, (await client.get_server_info())["scheduler_stats"]

    first, second, before, after = run(go())
    assert first["output_ids"] == reference_greedy(qwen3_dir, PROMPTS[0], 8)[0]
    assert second["output_ids"] == reference_greedy(qwen3_dir, PROMPTS[1], 8)[0]
    assert after["joined"] == before["joined"] + 1
    assert after["recomputed_prefixes"] == before["recomputed_prefixes"]  # the dense cache re-prefills both


@pytest.mark.parametrize("server", ["small", "waits"])
def test_a_running_sequence_pages_are_cached_as_its_decode_steps_fill_them(small_pool_servers, qwen3_dir, server):
    """A page a decode step filled is recorded once that step is read back, not at the sequence's end:
    a request that starts with a running one's prompt and output so far reuses them (and gets the
    tokens of a plain forward), with the overlapped decode step and without it."""
    prompt = [14, 3, 15, 9, 2, 6, 5, 35, 8, 9]  # 10 tokens: 2 full pages of 4, recorded at its prefill
    served = small_pool_servers[server]
    call(served, "flush_cache")
    so_far = reference_greedy(qwen3_dir, prompt, 9)[0]

    async def go():
        async with client_for(served) as client:
            # 9 tokens each: 18 of KV (its 9th output is not fed yet), pages 3 and 4 filled by decode steps
            first = await held_in_flight(client, steps=9, input_ids=prompt, sampling_params=_greedy(16))
            second = asyncio.create_task(
                client.generate(input_ids=[*prompt, *so_far[:8], 1], sampling_params=_greedy(2))
            )
            await scheduler_stats_when(client, lambda s: s["waiting_requests"] == 1, task=second)
            await client.continue_generation()  # the first is still running when the second prefills
            return await first, await second

    first, second = run(go())
    assert second["meta_info"]["cached_tokens"] == 16  # 8 at the first's prefill, 8 more from its decode steps
    assert second["output_ids"] == reference_greedy(qwen3_dir, [*prompt, *so_far[:8], 1], 2)[0]
    assert first["output_ids"] == reference_greedy(qwen3_dir, prompt, 16)[0]


def test_a_request_the_whole_pool_cannot_hold_is_refused_and_the_engine_goes_on(small_pool_server):
    answer = call(small_pool_server, "generate", input_ids=list(range(1, 120)), sampling_params=_greedy(4))
    reason = answer["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and "--max-total-tokens" in reason["message"], reason
    ok = call(small_pool_server, "generate", input_ids=PROMPTS[1], sampling_params=_greedy(2))
    assert len(ok["output_ids"]) == 2


def test_samples_waiting_on_an_aborted_first_sample_prefill_themselves(small_pool_server, qwen3_dir):
    """The n samples of a prompt wait for the first one's prefill (13 tokens: two chunks of 8 here);
    when that first sample is aborted alone mid-prefill, the others prefill themselves."""
    prompt = PROMPTS[2]

    async def go():
        async with client_for(small_pool_server) as client:
            task = await held_in_flight(
                client, steps=1, samples=3, input_ids=prompt, sampling_params=_greedy(4, n=3), rid="orphans"
            )
            await client.abort_request(rid="orphans-0")
            await client.continue_generation()
            return await asyncio.wait_for(task, timeout=60)

    answers = {a["meta_info"]["id"]: a for a in run(go())}
    assert answers["orphans-0"]["meta_info"]["finish_reason"]["type"] == "abort"
    want = reference_greedy(qwen3_dir, prompt, 4)[0]
    assert [answers[f"orphans-{i}"]["output_ids"] for i in (1, 2)] == [want, want]


def test_prefills_that_only_wait_on_each_other_for_pages_preempt_the_last_admitted():
    """Two long prompts mid-prefill hold every page and neither can take its next chunk (nothing
    decodes to free any): the one admitted last gives its pages back and waits, the first goes on."""
    from rollfleet.engine.kv.steps import PagedBatches
    from rollfleet.engine.sequences.logprobs import LogprobAsk
    from rollfleet.engine.sequences.next_token import StopRules
    from rollfleet.engine.sequences.sampling import Sampler
    from rollfleet.engine.sequences.sequence import sample_group
    from rollfleet.wire.protocol import SamplingParams

    fed = []

    def lockstep(action, rows, logits_at, **_):
        fed.append([len(tokens) for _, tokens, _ in rows])
        return torch.zeros(len(logits_at), 32)

    blocks = BlockPool(num_pages=7, page_size=4, prefix_cache=False)  # 6 usable pages: 24 tokens
    stops = StopRules(frozenset(), 512, None)
    batches = PagedBatches(
        blocks,
        lockstep=lockstep,
        sampler=Sampler(),
        stops=stops,
        read_routes=lambda: None,
        kv_epoch=lambda: 0,
        weights_generation=lambda: 0,
        adapter_identity=lambda lora_name: "base",
        chunk_tokens=8,
    )
    batches.epoch = 0  # the pool's epoch these pages are from (a first step would otherwise start afresh)
    params = SamplingParams(temperature=0, max_new_tokens=2, ignore_eos=True)
    first, last = (sample_group(list(range(1, 21)), params, rid, False, None, LogprobAsk())[0] for rid in "ab")
    for seq in (first, last):  # 12 of 20 prompt tokens in: 3 pages each, the pool is full
        seq.pages, seq.kv_len = blocks.allocate(3), 12
    outcome = batches.advance([first, last], recompute=False, lora_name=None)
    assert outcome.preempted == [last] and not last.pages and last.kv_len == 0
    assert fed == [[8]] and first.kv_len == 20 and len(first.output_ids) == 1


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--page-size", "0"], "--page-size 0"),
        (["--max-total-tokens", "8", "--page-size", "16"], "--max-total-tokens 8"),
        (["--chunked-prefill-size", "0"], "--chunked-prefill-size 0"),
        (["--rollfleet-shared-prefix-keys", "-1"], "--rollfleet-shared-prefix-keys -1"),
    ],
)
def test_kv_flags_that_cannot_work_are_refused_naming_the_flag(qwen3_dir, flags, named, capsys):
    from rollfleet.engine.process.server_args import build_parser, check_args

    parser = build_parser()
    args = parser.parse_args(["--model-path", qwen3_dir, "--device", "cpu", *flags])
    with pytest.raises(SystemExit):
        check_args(parser, args)
    assert named in capsys.readouterr().err


def test_the_memory_saver_is_chosen_once_at_start_and_off_without_a_gpu(small_pool_server, qwen3_dir, monkeypatch):
    from rollfleet.engine.kv import saver
    from rollfleet.engine.process.server_args import build_parser

    info = call(small_pool_server, "get_server_info")
    assert info["rollfleet_kv_cache"]["memory_saver"] is False and info["rollfleet_memory_saver"] == "off"
    parser = build_parser()
    args = parser.parse_args(["--model-path", qwen3_dir, "--device", "cpu"])
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)  # resolve sets it: put back at the end
    assert "--device cpu" in saver.resolve(parser, args) and args.rollfleet_memory_saver == "off"
    assert saver.os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"  # off: as before the saver
    args = parser.parse_args(["--model-path", qwen3_dir, "--device", "cuda", "--rollfleet-kv-cache", "dense"])
    assert "--rollfleet-kv-cache dense" in saver.unavailable(args)
    args = parser.parse_args(["--model-path", qwen3_dir, "--device", "cuda"])
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    assert "expandable_segments" in saver.unavailable(args)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    monkeypatch.setattr(saver.importlib.util, "find_spec", lambda name: None)  # as where it is not installed
    assert "not installed" in saver.unavailable(args)


def test_memory_saver_on_where_it_cannot_run_is_a_start_error(qwen3_dir, capsys):
    from rollfleet.engine.kv import saver
    from rollfleet.engine.process.server_args import build_parser

    parser = build_parser()
    args = parser.parse_args(["--model-path", qwen3_dir, "--device", "cpu", "--rollfleet-memory-saver", "on"])
    with pytest.raises(SystemExit):
        saver.resolve(parser, args)
    assert "--rollfleet-memory-saver on: --device cpu" in capsys.readouterr().err


def test_a_next_turn_starts_from_the_cached_pages_of_the_previous_turn_output(small_pool_server, qwen3_dir):
    """A multi-turn episode's next request is the whole token list so far: the pages a finished turn
    filled, its output's included, are cached for it."""
    call(small_pool_server, "flush_cache")
    prompt = [13, 12, 11, 10, 9, 8, 7, 6, 5, 4]  # 10 tokens
    turn = call(small_pool_server, "generate", input_ids=prompt, sampling_params=_greedy(6))
    history = [*prompt, *turn["output_ids"], 17]  # + an observation token
    again = call(small_pool_server, "generate", input_ids=history, sampling_params=_greedy(3))
    assert again["meta_info"]["cached_tokens"] == 12  # 15 tokens of KV (the last output is never fed): 3 pages
    assert again["output_ids"] == reference_greedy(qwen3_dir, history, 3)[0]


class _SaverRecord:
    """Stands for torch_memory_saver's pause and resume (CUDA only), recording them by tag."""

    def __init__(self):
        self.calls: list[tuple[str, str]] = []

    def pause(self, tag, device=None):
        self.calls.append(("pause", tag))

    def resume(self, tag):
        self.calls.append(("resume", tag))


def test_a_kv_cache_resume_brings_paused_graphs_back_once():
    """XTuner's cycle (release all tags; resume weights, then kv_cache; never cuda_graph, which its
    SGLang predates): the graphs come back with the KV, so decode replays them; a later resume of
    cuda_graph, or of the KV again, maps nothing twice."""
    from rollfleet.engine.kv.graphs import DecodeGraphs

    model = AutoModelForCausalLM.from_config(tiny_config("qwen3")).eval()
    paged = PagedModel(model, _NoAdapter(), None, tp_size=1, device=torch.device("cpu"), page_size=4, graphs=False)
    paged.allocate(num_pages=8, max_graph_batch=0)
    saver = _SaverRecord()
    paged.graphs = DecodeGraphs(paged._forward, torch.device("cpu"), saver=saver)
    paged.release(["kv_cache", "weights", "cuda_graph"])
    assert paged.graphs.paused and saver.calls == [("pause", "cuda_graph")]
    paged.resume(["kv_cache"])
    assert not paged.graphs.paused and saver.calls[-1] == ("resume", "cuda_graph")
    paged.resume(["cuda_graph"])
    paged.resume(["kv_cache"])
    assert saver.calls == [("pause", "cuda_graph"), ("resume", "cuda_graph")]
    paged.release(["cuda_graph"])  # the graphs alone (the KV kept): they stay paused until named
    paged.resume(["weights"])
    assert paged.graphs.paused


def test_overlapped_decode_steps_answer_as_steps_that_wait(small_pool_servers):
    """The default server overlaps a decode step with the host's work on the last one (kv/overlap.py);
    `--disable-overlap-schedule` waits. Through a pool that preempts, chunked prompts, stop tokens and
    strings seen one step late, min_new_tokens, seeded draws with top-k logprobs and n samples, both
    answer the same tokens, finish reasons and logprobs."""
    prompts = [[3 + i, *range(40 + 5 * i, 52 + 5 * i)] for i in range(3)]
    probe = call(small_pool_servers["waits"], "generate", input_ids=prompts[1], sampling_params=_greedy(12))
    text, tokens = probe["text"], probe["output_ids"]
    asks = [
        {"sampling_params": _greedy(14)},
        {"sampling_params": _greedy(12, stop_token_ids=[tokens[5]])},
        {"sampling_params": {**_greedy(12), "stop": [text[len(text) // 2 : len(text) // 2 + 2]]}},
        {"sampling_params": {"temperature": 1.0, "max_new_tokens": 9, "min_new_tokens": 4, "sampling_seed": 5,
                             "n": 2}, "return_logprob": True, "top_logprobs_num": 2},
    ]  # fmt: skip
    answers = {}
    for key in ("small", "waits"):
        answers[key] = [call(small_pool_servers[key], "generate", input_ids=prompts, **ask) for ask in asks]
    for overlapped, waited in zip(answers["small"], answers["waits"]):
        for one, other in zip(overlapped, waited):
            assert one["output_ids"] == other["output_ids"]
            if "output_top_logprobs" in one["meta_info"]:  # each of the n samples its own rows (a fork's record)
                assert len(one["meta_info"]["output_top_logprobs"]) == len(one["output_ids"])
            assert one["text"] == other["text"]
            assert one["meta_info"]["finish_reason"] == other["meta_info"]["finish_reason"]
            for field in ("output_token_logprobs", "output_top_logprobs"):
                mine, theirs = one["meta_info"].get(field), other["meta_info"].get(field)
                assert (mine is None) == (theirs is None)
                assert str(mine) == str(theirs) or _close(mine, theirs), field
    reasons = {a["meta_info"]["finish_reason"]["type"] for group in answers["small"] for a in group}
    assert reasons == {"length", "stop"}
    overlapping = {key: not call(server, "get_server_info")["disable_overlap_schedule"] for key, server in
                   small_pool_servers.items()}  # fmt: skip
    assert overlapping == {"small": True, "waits": False}


def _close(a, b) -> bool:
    """Nested lists of logprobs and ids equal, the floats within float32 rounding of rows batched otherwise."""
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    if isinstance(a, float) or isinstance(b, float):
        return abs(a - b) <= 1e-4
    return a == b


def test_the_pools_pages_are_copied_released_and_resumed_in_every_layer():
    """A fork's page copy reaches every layer's keys and values; a release without the memory saver frees
    them, a resume zeroes them. One allocation per layer's keys and values: one for the whole pool made
    the saver's resume slower on an H100 (83-127 ms against 47-79 ms in the loop; docs/architecture.md)."""
    from rollfleet.engine.kv.pool import KVPool, KVShape

    pool = KVPool(KVShape(num_layers=3, kv_heads=2, head_dim=4, dtype=torch.float32), 5, 2, torch.device("cpu"))
    tensors = [*pool.keys, *pool.values]
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == 6
    assert pool.full_bytes() == pool.nbytes == 2 * 3 * 10 * 2 * 4 * 4
    for t in tensors:
        t.copy_(torch.randn_like(t))
    before = [t.clone() for t in tensors]
    pool.copy_pages([(1, 3), (0, 4)])  # page 3 <- page 1, page 4 <- page 0 (slots 2 per page)
    for got, was in zip(tensors, before):
        assert torch.equal(got[6:8], was[2:4]) and torch.equal(got[8:10], was[0:2])
        assert torch.equal(got[:6], was[:6])  # the other pages unchanged
    pool.release()
    assert all(t.untyped_storage().nbytes() == 0 for t in tensors) and pool.nbytes == 0 and pool.epoch == 1
    pool.resume()
    assert pool.nbytes == pool.full_bytes() and pool.epoch == 2
    assert all(torch.count_nonzero(t) == 0 for t in [*pool.keys, *pool.values])  # fresh storage, zeroed
