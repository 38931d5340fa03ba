"""A test that sleeps and then asserts or signals bets on the machine's speed. conftest runs this
check on every collected test module and refuses the run, naming the lines, when a sleep stands
anywhere but in a polling loop (a `while` that re-checks an observable) or the allowlist below."""

from __future__ import annotations

import ast
from pathlib import Path

# (module file name, function) -> why its sleep is no bet on speed
ALLOWED = {
    ("test_call_order.py", "_yield"): "asyncio.sleep(0) only yields to the event loop",
    ("feed_senders.py", "*"): "a helper process's pacing, no verdict depends on it",
    ("waits.py", "wait_until"): "the polling loop itself",
    ("conftest.py", "scheduler_stats_when"): "the polling loop itself",
}


def _is_sleep(node: ast.AST) -> bool:
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    module = getattr(getattr(func, "value", None), "id", "")
    named = isinstance(func, ast.Attribute) and func.attr == "sleep" and module in {"time", "asyncio"}
    if not named and not (isinstance(func, ast.Name) and func.id == "sleep"):
        return False
    zero = node.args and isinstance(node.args[0], ast.Constant) and node.args[0].value == 0
    return not zero  # asyncio.sleep(0) yields to the loop, it waits for nothing


def bare_sleeps(path: Path) -> list[str]:
    """`file:line in function` of each sleep outside a while loop and the allowlist."""
    found: list[str] = []

    def visit(node: ast.AST, function: str, in_poll: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                visit(child, getattr(child, "name", function), False)
                continue
            if _is_sleep(child) and not in_poll:
                if (path.name, function) not in ALLOWED and (path.name, "*") not in ALLOWED:
                    found.append(f"{path.name}:{child.lineno} in {function}")
            visit(child, function, in_poll or isinstance(child, ast.While))

    visit(ast.parse(path.read_text()), "<module>", False)
    return found
