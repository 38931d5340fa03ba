"""Which decode rows share leading pages (kv/prefix_groups.py): the groups the decode kernel's prefix
pass reads once for all their rows. Pure host logic; the kernel's side is in test_kv_decode_kernel.py."""

from __future__ import annotations

import torch

from rollfleet.engine.kv.prefix_groups import MAX_MEMBERS, MIN_SHARED_KEYS, PrefixGroups, prefix_groups

PAGE = 4


def _samples(first_page: int, prompt_pages: int, own: list[int]) -> list[list[int]]:
    """Page lists of a request's samples: its prompt's pages, then `own[i]` pages of sample i's own."""
    shared = list(range(first_page, first_page + prompt_pages))
    start = first_page + prompt_pages
    lists = []
    for count in own:
        lists.append(shared + list(range(start, start + count)))
        start += count
    return lists


def test_a_requests_samples_share_their_prompts_full_pages():
    tables = _samples(1, 3, [1, 2, 1]) + _samples(100, 2, [1, 1])
    lens = [len(pages) * PAGE - 1 for pages in tables]  # every row's last page is being written
    counts, shared = prefix_groups(tables, lens, PAGE, members=64)
    assert counts == [3, 0, 0, 2, 0]
    assert shared == [3 * PAGE] * 3 + [2 * PAGE] * 2


def test_the_page_a_row_writes_this_step_is_never_shared():
    # two rows over the same two pages (a fork before either wrote on): the second page is being written
    tables = [[5, 6], [5, 6]]
    counts, shared = prefix_groups(tables, [PAGE + 2, PAGE + 2], PAGE, members=64)
    assert counts == [2, 0] and shared == [PAGE, PAGE]
    counts, shared = prefix_groups([[5], [5]], [3, 3], PAGE, members=64)  # nothing full before this step
    assert counts == [0, 0] and shared == [0, 0]


def test_rows_that_part_ways_share_what_all_of_them_share():
    tables = [[1, 2, 3, 9], [1, 2, 3, 10], [1, 2, 7, 11]]
    counts, shared = prefix_groups(tables, [4 * PAGE] * 3, PAGE, members=64)
    assert counts == [3, 0, 0] and shared == [2 * PAGE] * 3
    # a row whose first page differs ends the run; the rows after it start their own
    tables = [[1, 2, 8], [1, 2, 9], [4, 5, 10], [1, 2, 11]]
    counts, shared = prefix_groups(tables, [3 * PAGE] * 4, PAGE, members=64)
    assert counts == [2, 0, 0, 0] and shared == [2 * PAGE, 2 * PAGE, 0, 0]


def test_groups_hold_at_most_members_rows():
    tables = _samples(1, 2, [1] * 7)
    counts, shared = prefix_groups(tables, [3 * PAGE] * 7, PAGE, members=3)
    assert counts == [3, 0, 0, 3, 0, 0, 0] and shared == [2 * PAGE] * 6 + [0]


def test_the_groups_are_kept_while_the_rows_stay_and_worked_out_again_when_they_change():
    groups = PrefixGroups(PAGE, pin=False, min_keys=1)
    tables = _samples(1, 2, [1, 1, 1])
    rows = [(len(pages) * PAGE - 2, [0], pages) for pages in tables]
    first = groups.of(rows, batch=4)
    assert first.tolist() == [[3, 0, 0, 0], [2 * PAGE] * 3 + [0]]  # the padded row is in no group
    for pages in tables:  # a steady step: the same lists, grown
        pages.append(50 + len(pages))
    grown = [(start + PAGE, tokens, pages) for start, tokens, pages in rows]
    assert groups.of(grown, batch=4) is first
    del tables[1][1:]  # a list cut in place (its sample preempted): the groups are worked out again
    again = groups.of(grown, batch=4)
    assert again is not first and again.tolist() == [[3, 0, 0, 0], [PAGE] * 3 + [0]]  # they share one page now
    assert groups.of([(5, [0], [9, 10])], batch=1) is None  # no row shares pages: no prefix pass
    assert isinstance(first, torch.Tensor)


def test_groups_share_at_least_min_keys_or_are_none():
    tables = _samples(1, 3, [1, 1]) + _samples(50, 1, [1, 1])
    lens = [len(pages) * PAGE for pages in tables]
    counts, shared = prefix_groups(tables, lens, PAGE, members=64, min_keys=2 * PAGE + 1)  # 3 pages
    assert counts == [2, 0, 0, 0] and shared == [3 * PAGE] * 2 + [0, 0]
    # a row that would cut the group's shared pages below the least ends the group instead, and starts its own
    tables = [[1, 2, 3, 9], [1, 2, 3, 10], [1, 7, 8, 11], [1, 7, 8, 12]]
    counts, shared = prefix_groups(tables, [4 * PAGE] * 4, PAGE, members=64, min_keys=2 * PAGE)
    assert counts == [2, 0, 2, 0] and shared == [3 * PAGE] * 4
    # by default a GRPO wave's short prompts (64 tokens in pages of 16) take no prefix pass
    rows = [(80, [0], pages) for pages in _samples(1, 4, [2] * 8)]
    assert PrefixGroups(16, pin=False).of(rows, batch=8) is None
    long_prompt = [(MIN_SHARED_KEYS + 40, [0], pages) for pages in _samples(1, MIN_SHARED_KEYS // 16, [3] * 8)]
    assert PrefixGroups(16, pin=False).of(long_prompt, batch=8).tolist()[0] == [8] + [0] * 7


def test_the_decode_benchs_shared_prompt_rows_form_the_groups_it_asks_for():
    from rollfleet.bench.decode_step import decode_rows

    rows, pages = decode_rows(20, context=300, page_size=16, shared=128, samples=8)
    counts, shared = prefix_groups([p for _, _, p in rows], [start + 1 for start, _, _ in rows], 16, MAX_MEMBERS)
    assert counts[0::8] == [8, 8, 4] and sum(counts) == 20 and set(shared) == {128}
    assert pages == 1 + 3 * 8 + 20 * (19 - 8)  # 19 pages a row of 301 keys, 8 of them a group's
    rows, _ = decode_rows(4, context=300, page_size=16, shared=0, samples=8)
    assert prefix_groups([p for _, _, p in rows], [301] * 4, 16, MAX_MEMBERS)[0] == [0] * 4


def test_a_step_replays_the_graph_it_can_and_captures_only_what_it_must():
    from rollfleet.engine.kv.graphs import DecodeGraphs

    graphs = DecodeGraphs(forward=None, device=torch.device("cpu"), kernel=True)  # the choice alone, no capture
    assert graphs._captured(16, need=5, grouped=True) == (None, 8, True)  # nothing yet: capture with the pass
    graphs.graphs[(16, 8, True)] = "with the pass"
    assert graphs._captured(16, need=5, grouped=False) == ("with the pass", 8, True)  # its groups zero: no capture
    assert graphs._captured(16, need=9, grouped=False) == (None, 16, False)  # wider: a new graph, without the pass
    graphs.graphs[(16, 8, False)] = "without"
    assert graphs._captured(16, need=5, grouped=False) == ("without", 8, False)  # the plain one where there is one
    assert graphs._captured(16, need=5, grouped=True) == ("with the pass", 8, True)
    del graphs.graphs[(16, 8, True)]
    assert graphs._captured(16, need=5, grouped=True) == (None, 8, True)  # a step with groups needs the pass
