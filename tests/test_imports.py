"""Imports run one way: cli -> train -> agents -> fleet -> (engine, weights) -> wire -> config -> leaves (layout, ...).

A module may import its own subpackage and any layer below its own; never a layer above, and
never the other package of its own layer (engine and weights do not know each other)."""

from __future__ import annotations

import ast
from pathlib import Path

import rollfleet

PACKAGE = Path(rollfleet.__file__).parent

LAYERS = {
    "__main__": 9, "cli": 8, "demo": 7, "bench": 7,
    "train": 6,
    "agents": 5,  # multi-turn episodes over the fleet
    "fleet": 4,
    "engine": 3, "weights": 3,
    "wire": 2,
    "config": 1, "envs": 1,  # config builds the one Layout; envs: the environment interface, the demo's
    "layout": 0, "sample": 0, "data": 0, "rewards": 0, "tiny_models": 0, "__init__": 0,
}  # fmt: skip


def _unit(module: str) -> str:
    """The subpackage or top-level module of a dotted rollfleet module name."""
    return module.split(".")[1] if module.count(".") else module


def _imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):  # function-level imports count too
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
    return [(line, name) for line, name in found if name == "rollfleet" or name.startswith("rollfleet.")]


def _violations() -> list[str]:
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE.parent).with_suffix("")
        source = _unit(".".join(relative.parts))
        assert source in LAYERS, f"{relative}: put {source!r} in a layer of LAYERS in tests/test_imports.py"
        for line, module in _imports(path):
            target = _unit(module)
            if target == source:
                continue
            if target not in LAYERS:
                bad.append(f"{relative}:{line} imports {module}: unknown unit {target!r}")
            elif LAYERS[target] >= LAYERS[source]:
                way = "sideways" if LAYERS[target] == LAYERS[source] else "up"
                bad.append(f"{relative}:{line} imports {module} ({way}: {source} -> {target})")
    return bad


def test_imports_run_one_way():
    bad = _violations()
    assert not bad, "imports against the layers:\n" + "\n".join(bad)


def test_the_check_sees_function_level_imports(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from rollfleet.fleet.fleet import Fleet\n")
    assert _imports(module) == [(2, "rollfleet.fleet.fleet")]


def test_no_module_over_400_lines_and_no_function_over_60():
    """A newcomer reads one job per module and one step per function (docs/architecture.md)."""
    too_long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        relative = path.relative_to(PACKAGE.parent)
        if len(text.splitlines()) > 400:
            too_long.append(f"{relative}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno >= 60:
                too_long.append(f"{relative}:{node.lineno} {node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert not too_long, "split these:\n" + "\n".join(too_long)
