"""Which rows of a decode step share their leading pages (a request's samples over its prompt), for
the decode kernel's prefix pass (kv/decode_kernel.py): the pages such a group shares are read once
for all its rows instead of once a row.

`prefix_groups` works the groups out from the rows' page lists; `PrefixGroups` keeps them from step
to step while the running set holds (a steady decode step: the same lists in the same rows, which
only grow), as kv/tables.py keeps the block table.
"""

from __future__ import annotations

import torch

from rollfleet.engine.sequences.sampling import same_objects

MAX_MEMBERS = 64  # rows a group takes at most (the kernel takes them a tile at a time)
# Keys a group must share for the prefix pass to pay: it costs two launches a layer and a second slot
# of every row's partial (written, then merged). On an H100 (scripts/bench_prefix_attention.py, 512
# rows in groups of 8) it lost 0.14-0.38 ms a step over 64 shared keys, where the GPU's L2 cache
# already serves a group's shared pages to its other rows (8 rows reading the same 64 keys: 11% faster
# than 8 distinct), and gained 1.6-2.1 ms over 1,024 (20-43% of the attention's time); even near 200
# keys by a straight line between the two (not measured there).
MIN_SHARED_KEYS = 256


def prefix_groups(
    tables: list[list[int]], lens: list[int], page_size: int, members: int, min_keys: int = 1
) -> list[list[int]]:
    """[counts, shared keys] of a decode step's rows (`tables`: each row's pages; `lens`: its keys with
    this step's): a run of neighbouring rows whose leading pages are the same pages (a request's
    samples over its prompt) is a group of at most `members` rows; its first row's count is the
    group's size (other rows' 0), and every member's shared keys are the pages all members share
    that none of them writes this step, in keys (0 outside groups). A row joins its neighbours' group
    only while they still share `min_keys` keys or more."""
    least = max(1, -(-min_keys // page_size))  # pages
    rows = len(tables)
    counts, shared = [0] * rows, [0] * rows
    row = 0
    while row < rows:
        lead = tables[row]
        full = (lens[row] - 1) // page_size  # pages written before this step's key
        end, common = row + 1, min(len(lead), full)
        while end < rows and end - row < members and common >= least:
            pages = tables[end]
            if not pages or pages[0] != lead[0]:
                break
            limit = min(common, len(pages), (lens[end] - 1) // page_size)
            same = 0
            while same < limit and pages[same] == lead[same]:
                same += 1
            if same < least:
                break
            common, end = same, end + 1
        if end - row > 1 and common >= least:
            counts[row] = end - row
            shared[row:end] = [common * page_size] * (end - row)
        row = end
    return [counts, shared]


class PrefixGroups:
    """The groups of the steps' rows, worked out again only when the running set changed."""

    def __init__(self, page_size: int, pin: bool, min_keys: int = MIN_SHARED_KEYS):
        self.page_size, self.pin, self.min_keys = page_size, pin, min_keys
        self._lists: list[list[int]] = []
        self._lengths: list[int] = []
        self._batch = 0
        self._host: torch.Tensor | None = None

    def of(self, rows, batch: int) -> torch.Tensor | None:
        """[2, batch] (pinned) of `rows` ((KV length before the step, [token], pages) each), padded rows
        in no group; None when no rows share `min_keys` keys with their neighbours."""
        tables = [pages for _, _, pages in rows]
        lengths = list(map(len, tables))
        steady = same_objects(tables, self._lists) and batch == self._batch
        if not (steady and all(map(int.__ge__, lengths, self._lengths))):  # a list cut in place: again
            lens = [start + len(tokens) for start, tokens, _ in rows]
            counts, shared = prefix_groups(tables, lens, self.page_size, MAX_MEMBERS, self.min_keys)
            host = None
            if any(count > 1 for count in counts):
                host = torch.zeros(2, batch, dtype=torch.long, pin_memory=self.pin)
                host[:, : len(rows)] = torch.tensor([counts, shared], dtype=torch.long)
            self._host, self._batch = host, batch
        self._lists, self._lengths = tables, lengths
        return self._host
