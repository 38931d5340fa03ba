"""The KV pool's pages on the host (rollfleet/engine/kv/blocks.py): reference counts, the prefix
cache, eviction, and the invariants any sequence of operations keeps."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollfleet.engine.kv.blocks import TRASH_PAGE, BlockPool, OutOfPages, page_hashes
from rollfleet.engine.kv.graphs import graph_width, width_bucket
from rollfleet.engine.kv.tables import TableMirror, step_inputs


def _accounted(pool: BlockPool, held: dict[int, int]) -> None:
    """Every page but the trash page is free, idle in the cache, or held as often as the holders say."""
    assert sorted(pool.free + list(pool.idle_cached) + list(held)) == list(range(1, pool.num_pages))
    assert all(pool.refs[page] == count for page, count in held.items())
    assert TRASH_PAGE not in pool.free and pool.refs[TRASH_PAGE] == 0
    assert set(pool.idle_cached) <= set(pool.hash_of)
    assert {pool.page_of[d] for d in pool.hash_of.values()} == set(pool.hash_of)


OPS = st.sampled_from(["alloc", "hold", "release", "register", "match", "flush"])


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(OPS, st.integers(0, 6)), max_size=60))
def test_any_sequence_of_operations_keeps_every_page_accounted_for(ops):
    pool = BlockPool(num_pages=12, page_size=2)
    holders: list[list[int]] = []  # each holder's pages (a page may appear in several)
    tokens = {}  # holder index -> the tokens its pages hold
    for op, arg in ops:
        if op == "alloc":
            try:
                holders.append(pool.allocate(arg))
                tokens[len(holders) - 1] = [arg % 3] * (2 * arg)
            except OutOfPages:
                assert arg > pool.available
        elif op in ("hold", "release", "register") and holders:
            index = arg % len(holders)
            if op == "hold":
                pool.hold(holders[index])
                holders.append(list(holders[index]))
                tokens[len(holders) - 1] = tokens[index]
            elif op == "release":
                pool.release(holders[index])
                holders[index] = []
            else:
                pool.register(tokens[index][: 2 * len(holders[index])], holders[index], "root")
        elif op == "match":
            pages = pool.match([arg % 3] * (2 * arg + 1), "root")
            holders.append(pages)
            tokens[len(holders) - 1] = [arg % 3] * (2 * len(pages))
        elif op == "flush":
            pool.flush()
        held: dict[int, int] = {}
        for pages in holders:
            for page in pages:
                held[page] = held.get(page, 0) + 1
        _accounted(pool, held)


def test_refcounts_free_a_page_once_its_last_holder_releases_it():
    pool = BlockPool(num_pages=4, page_size=4, prefix_cache=False)
    pages = pool.allocate(2)
    pool.hold(pages[:1])  # a fork shares the first page
    pool.release(pages)
    assert pool.available == 2 and pool.refs[pages[0]] == 1
    pool.release(pages[:1])
    assert pool.available == 3
    with pytest.raises(OutOfPages):
        pool.allocate(4)
    assert pool.available == 3  # a refused allocation takes nothing


def test_prefix_cache_matches_full_pages_and_leaves_a_token_to_compute():
    pool = BlockPool(num_pages=16, page_size=4)
    prompt = list(range(10, 22))  # 12 tokens: 3 full pages
    pages = pool.allocate(3)
    pool.register(prompt, pages, "lora:None")
    assert pool.match(prompt, "lora:None") == pages[:2]  # the last page would leave nothing to compute
    assert pool.match([*prompt, 99], "lora:None") == pages
    assert pool.match(prompt, "lora:other") == []  # another adapter's KV is not this one's
    assert pool.match([0, *prompt], "lora:None") == []  # a chain: the same page after other tokens differs
    changed = [*prompt[:5], 0, *prompt[6:], 1]
    assert pool.match(changed, "lora:None") == pages[:1]
    pool.flush()
    assert pool.match([*prompt, 99], "lora:None") == []


def test_a_finished_sample_on_its_recorded_prompt_records_what_a_fresh_chain_would():
    """A sample's prompt pages were recorded at its prefill (its n siblings share them): its finish
    hashes only the pages after them, chained on the last recorded one, and records the same pages
    under the same hashes as a pool that hashes the whole chain."""
    prompt, outputs = list(range(10, 22)), [list(range(40 + s, 52 + s)) for s in range(3)]
    pools, tables = [], []
    for recorded_prompt in (True, False):
        pool = BlockPool(num_pages=32, page_size=4)
        shared = pool.allocate(3)
        if recorded_prompt:
            pool.register(prompt, shared, "root")  # the leader's prefill
        for output in outputs:  # three samples: the prompt's pages held by each, their own after them
            pool.hold(shared)
            pool.register([*prompt, *output], shared + pool.allocate(3), "root")
        pools.append(pool)
        tables.append(sorted(pool.page_of.items()))
    assert tables[0] == tables[1] and len(tables[0]) == 3 + 3 * 3
    assert page_hashes([*prompt, *outputs[0]], 4, "root")[3:] == page_hashes(
        [*prompt, *outputs[0]], 4, "root", start=3, previous=page_hashes(prompt, 4, "root")[-1]
    )
    for pool in pools:  # and what is recorded is found again from the tokens alone
        assert len(pool.match([*prompt, *outputs[1], 0], "root")) == 6


def test_pages_recorded_as_decode_fills_them_are_those_the_whole_chain_records():
    """A running sample's pages recorded one by one as its steps fill them (`record_filled`) carry the
    hashes a whole chain gives them; a page whose page before is not recorded (its content is held by
    another page) is left, and `register` at the end records it as a fresh pool would."""
    prompt, output = list(range(10, 20)), list(range(40, 54))  # 10 + 14 tokens: 6 pages of 4
    tokens = [*prompt, *output]
    whole = BlockPool(num_pages=32, page_size=4)
    whole.register(tokens, whole.allocate(6), "root")
    pool = BlockPool(num_pages=32, page_size=4)
    pages = pool.allocate(6)
    pool.register(prompt, pages[:3], "root")  # the prefill: its 2 full pages
    for filled in range(3, 7):  # decode steps fill pages 3 to 6
        pool.record_filled([(pages, filled, tokens[4 * filled - 4 : 4 * filled], "root")])
    assert [pool.hash_of[page] for page in pages] == [whole.hash_of[page] for page in sorted(whole.hash_of)]
    assert pool.match([*tokens, 0], "root") == pages and pool.refs[pages[0]] == 2

    twin = pool.allocate(6)  # the same tokens in other pages: nothing of it is recorded as it fills
    for filled in range(1, 7):
        pool.record_filled([(twin, filled, tokens[4 * filled - 4 : 4 * filled], "root")])
    assert not set(twin) & set(pool.hash_of)
    other = [*tokens[:8], 0, 1, 2, 3, *tokens[12:]]  # page 3 differs: its pages after it chain on its own hash
    late = pool.allocate(6)
    pool.record_filled([(late, 1, other[:4], "root")])  # page 1 duplicates a recorded one: not recorded
    pool.record_filled([(late, 4, other[12:16], "root")])  # its page before is not recorded: left for later
    assert not set(late) & set(pool.hash_of)
    pool.register(other, late, "root")  # its end: the pages no other one holds
    assert pool.match([*other, 0], "root") == [*pages[:2], *late[2:]]


def test_idle_cached_pages_are_reused_oldest_first_when_the_pool_runs_out():
    pool = BlockPool(num_pages=5, page_size=2)  # 4 usable
    a, b = pool.allocate(2), pool.allocate(2)
    pool.register([1, 1, 2, 2], a, "r")
    pool.register([3, 3, 4, 4], b, "r")
    pool.release(a)
    pool.release(b)
    assert pool.available == 4 and not pool.free  # all idle in the cache
    taken = pool.allocate(2)
    assert taken == a  # the least recently released
    assert pool.match([1, 1, 2, 2, 5], "r") == []
    assert pool.match([3, 3, 4, 4, 5], "r") == b
    assert page_hashes([3, 3, 4, 4], 2, "r") == [pool.hash_of[p] for p in b]


def test_a_pool_without_prefix_cache_records_nothing():
    pool = BlockPool(num_pages=4, page_size=2, prefix_cache=False)
    pages = pool.allocate(1)
    pool.register([1, 2], pages, "r")
    pool.release(pages)
    assert pool.match([1, 2, 3], "r") == [] and pool.available == 3


@given(st.integers(1, 5000), st.booleans())
def test_a_graph_width_holds_the_rows_and_reuses_a_wider_capture(pages, coarse):
    width = width_bucket(pages, coarse)
    assert width >= pages
    if coarse and pages <= 64:
        assert width >= 8 and width & (width - 1) == 0  # powers of two: few captures over a run
    else:  # the gather path, and long rows (their table is built every step): little padding
        assert width - pages < max(4, (1 << (pages - 1).bit_length()) // 8)
    assert graph_width([], pages, coarse) == width
    assert graph_width([width + 7, width * 4], pages, coarse) == width + 7  # the narrowest that fits
    assert graph_width([pages - 1] if pages > 1 else [], pages, coarse) == width  # too narrow: a new one


MIRROR_ACTIONS = ["grow", "replace", "leave", "join", "swap", "cut", "same", "same"]


@settings(max_examples=120, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 7), st.sampled_from(MIRROR_ACTIONS)), max_size=50))
def test_the_table_mirror_equals_the_table_built_from_scratch(script):
    """The running rows grow by appending, get new lists (forks, preemptions), leave (the rows after
    them move up), join at the end, swap places, are cut short in place, or stay as they were (the
    steady step); after every step the mirror holds exactly each row's pages and zeros past them,
    and rows past the step's are all zeros."""
    width, batch = 24, 8
    mirror, running, page = TableMirror(batch, width, pin=False), [[1]], iter(range(2, 10**6))
    for row, action in script:
        row = row % len(running) if running else 0
        if action == "grow" and running and len(running[row]) < width:
            running[row] += [next(page) for _ in range(min(3, width - len(running[row])))]  # the same list
        elif action == "replace" and running:
            running[row] = [next(page) for _ in range(row % 4 + 1)]  # another sequence's list
        elif action == "leave" and running:
            del running[row]
        elif action == "join" and len(running) < batch:
            running.append([next(page) for _ in range(row % 3)])
        elif action == "swap" and running:
            running[0], running[row] = running[row], running[0]
        elif action == "cut" and running:
            del running[row][row % 2 :]  # in place: the same list, shorter
        table = mirror.update(running)
        want = torch.zeros(batch, width, dtype=torch.long)
        for i, pages in enumerate(running):
            want[i, : len(pages)] = torch.tensor(pages, dtype=torch.long)
        assert torch.equal(table, want), (running, table)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(1, 900)), min_size=1, max_size=8), st.booleans())
def test_a_graph_step_s_host_inputs_are_each_row_s_token_position_slot_and_keys(rows, fed):
    """`step_inputs`: per row its fed token (or zeros when the tokens are on the device), position,
    the slot of that position in its pages, and its key count; padded rows feed token 0 at position 0
    into slot 0 (the trash page) over one key."""
    size, batch, fresh = 4, 8, iter(range(1, 10**6))
    steps = [(start, [token], [next(fresh) for _ in range(start // size + 1 + start % 2)]) for start, token in rows]
    host, table = step_inputs(steps, size, TableMirror(batch, 16, pin=False), fed=fed)
    pad = batch - len(steps)
    want = [
        [token if fed else 0 for _, (token,), _ in steps] + [0] * pad,
        [start for start, _, _ in steps] + [0] * pad,
        [pages[start // size] * size + start % size for start, _, pages in steps] + [0] * pad,
        [start + 1 for start, _, _ in steps] + [1] * pad,
    ]
    assert host.tolist() == want
    assert all(table[i, : len(pages)].tolist() == pages for i, (_, _, pages) in enumerate(steps))


def test_a_graph_step_whose_row_has_no_page_for_its_position_is_refused():
    with pytest.raises(RuntimeError, match="decode row 1 writes at position 8 past its pages"):
        step_inputs([(0, [5], [3]), (8, [6], [4, 7])], 4, TableMirror(2, 4, pin=False))
