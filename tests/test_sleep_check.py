"""The conftest check that refuses a run whose tests sleep before they assert or signal (sleep_check.py)."""

from __future__ import annotations

from sleep_check import bare_sleeps


def test_a_sleep_before_an_assertion_is_named_and_a_polling_loop_is_not(tmp_path):
    module = tmp_path / "test_m.py"
    # the sleeps below are the checker's input, written to a file and never run: they decide nothing
    module.write_text(
        "import asyncio, time\n"
        "def test_bets():\n"
        "    time.sleep(0.3)\n"
        "    assert True\n"
        "async def test_bets_too():\n"
        "    await asyncio.sleep(0.1)\n"
        "def test_polls():\n"
        "    while not ready():\n"
        "        time.sleep(0.02)\n"
        "async def test_yields():\n"
        "    await asyncio.sleep(0)\n"
    )
    assert bare_sleeps(module) == ["test_m.py:3 in test_bets", "test_m.py:6 in test_bets_too"]


def test_the_suite_has_no_bare_sleep():
    from pathlib import Path

    here = Path(__file__).parent
    assert [line for path in sorted(here.glob("*.py")) for line in bare_sleeps(path)] == []
