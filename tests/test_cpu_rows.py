"""kv/cpu_rows.py: the number of rows from which this CPU's products round every row alike, checked
on the machine the suite runs on, past the probe's own rows."""

from __future__ import annotations

import pytest
import torch

from rollfleet.engine.kv.cpu_rows import FLOOR, PROBE_ROWS, rows_alike_from


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("width", [16, 64, 128, 512, 2048])
def test_products_of_as_many_rows_as_measured_round_each_row_as_any_larger_product(one_thread, width):
    least = rows_alike_from([width])
    assert FLOOR <= least <= PROBE_ROWS
    gen = torch.Generator().manual_seed(1)  # not the probe's numbers
    x, w = torch.randn(300, width, generator=gen), torch.randn(96, width, generator=gen)
    full = torch.nn.functional.linear(x, w)
    for rows in [least, least + 1, least + 7, 100, 129, 256, 300]:
        assert torch.equal(torch.nn.functional.linear(x[:rows], w), full[:rows]), (width, least, rows)


def test_the_widest_width_decides(one_thread):
    widths = [64, 512]
    assert rows_alike_from(widths) == max(rows_alike_from([w]) for w in widths)
