"""A decode graph's block table on the host, kept from step to step so that a step writes only what
changed: the pages a row gained, a row copied when its sequence moved up (one before it left),
a whole row for a sequence new to the table.

Building the table from Python lists every step costs rows x pages (512 rows of 4,096-token
contexts: 131,072 ids, 8.1 ms a step on a 2-core CPU; this mirror 0.8 ms, 1.6 ms when every row
moved up); a sequence's page list only grows by appending
(kv/steps.py `_grow`) or is replaced by a new list (forks, preemptions, releases), so a list that
is the same object as last step needs only its new tail written. The mirror keeps a reference to
each row's list (an id alone could be reused by a new list) and its length then; every write of a
step is one tensor operation. The steady decode step (every row's list the one it had last step,
in the same row) only compares lengths (512 rows on the 2-core CPU: 0.04 ms a step when no row
grew, 0.5 when every row gained a page, once in 16 steps; the walk it replaces took 0.33 ms a step
by py-spy on an H100's host). `step_inputs` gives a graph the rest of its inputs from the rows in a
few tensor operations.
"""

from __future__ import annotations

import itertools
import operator

import torch

from rollfleet.engine.sequences.sampling import same_objects


class TableMirror:
    def __init__(self, batch: int, width: int, pin: bool):
        self.host = torch.zeros(batch, width, dtype=torch.long, pin_memory=pin)
        self.pinned = pin
        self._lists: list[list[int]] = []  # each row's page list last step (a reference: ids are reused)
        self._lengths: list[int] = []  # and its length then

    def update(self, tables: list[list[int]]) -> torch.Tensor:
        """The host table of `tables` (each row's pages, in the step's order; rows past them: the
        trash page 0). A list seen last step keeps what it had: copied with its row when the row
        moved (a sequence before it left), only the pages it gained written; others written whole.
        The steady step (the same lists in the same rows) only compares lengths."""
        lengths = list(map(len, tables))
        if same_objects(tables, self._lists):
            changed = itertools.compress(range(len(tables)), map(operator.ne, lengths, self._lengths))
            grown, fresh = {}, []
            for row in changed:  # a list cut in place (shorter) is written whole
                if lengths[row] > self._lengths[row]:
                    grown[row] = self._lengths[row]
                else:
                    fresh.append(row)
            self._write(tables, [], [], fresh, grown)
        else:
            self._rebuild(tables)
        self._lists, self._lengths = list(tables), lengths
        return self.host

    def _rebuild(self, tables: list[list[int]]) -> None:
        where = {id(pages): row for row, pages in enumerate(self._lists)}
        moved_to, moved_from, fresh, grown = [], [], [], {}
        for row, pages in enumerate(tables):
            seen = where.get(id(pages))
            if seen is not None and len(pages) >= self._lengths[seen]:
                grown[row] = self._lengths[seen]
                if seen != row:
                    moved_to.append(row), moved_from.append(seen)
            else:
                fresh.append(row)
        self._write(tables, moved_to, moved_from, fresh, grown)
        if len(self._lists) > len(tables):  # after the moves: a row may move up from there
            self.host[len(tables) : len(self._lists)] = 0

    def _write(
        self, tables, moved_to: list[int], moved_from: list[int], fresh: list[int], grown: dict[int, int]
    ) -> None:
        """Rows `moved_from` copied to `moved_to`, `fresh` rows zeroed and written whole, each `grown`
        row's pages past the count it had (its value) written; every write one tensor operation."""
        if moved_to:  # the right side is a copy: rows may move into rows that move on
            self.host[moved_to] = self.host[moved_from]
        if fresh:
            self.host[fresh] = 0
        at_rows, at_cols, values = [], [], []
        for row, start in itertools.chain(((row, 0) for row in fresh), grown.items()):
            pages = tables[row]
            if len(pages) > start:
                at_rows += [row] * (len(pages) - start)
                at_cols += range(start, len(pages))
                values += pages[start:]
        if values:
            self.host[at_rows, at_cols] = torch.tensor(values, dtype=torch.long)


def step_inputs(rows, page_size: int, mirror: TableMirror, fed: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode graph's inputs on the host for `rows` ((KV length, [token], pages) each): `[4, batch]`
    of the fed tokens (zeros unless `fed`), positions, KV slots and key counts (padded rows: token 0
    at position 0 in slot 0, the trash page's, over 1 key), and the block table (`mirror.update`).
    A few tensor operations over the rows, not four Python lists (0.2 ms a step at 512 rows)."""
    table = mirror.update([pages for _, _, pages in rows])
    count, batch = len(rows), mirror.host.shape[0]
    host = torch.zeros(4, batch, dtype=torch.long, pin_memory=mirror.pinned)
    starts = torch.tensor([start for start, _, _ in rows], dtype=torch.long)
    pages = table[:count].gather(1, (starts // page_size)[:, None])[:, 0]
    missing = (pages == 0).nonzero()  # a row's table holds no page for its position (its pages did not grow)
    if len(missing):
        row = int(missing[0, 0])
        raise RuntimeError(f"decode row {row} writes at position {int(starts[row])} past its pages {rows[row][2]}")
    if fed:
        host[0, :count] = torch.tensor([tokens[0] for _, tokens, _ in rows], dtype=torch.long)
    host[1, :count] = starts
    host[2, :count] = pages * page_size + starts % page_size
    host[3] = 1
    host[3, :count] += starts
    return host, table
