"""Imports run one way: cli -> train -> agents -> fleet -> (engine, weights) -> wire -> config -> leaves (layout, ...).

A module may import its own subpackage and any layer below its own; never a layer above, and
never the other package of its own layer (engine and weights do not know each other).

Inside the engine its subpackages have layers too (ENGINE_LAYERS): process -> http -> model -> weights
-> lora -> runtime -> kv -> sequences -> tp. An engine module imports its own subpackage and those
below it, and lives in one of them (no flat modules in rollfleet/engine/).

And no circles, inside a package or across packages: no module imports, even through others, a module
that imports it (TYPE_CHECKING and function-level imports count: a circle drawn only for the type
checker still ties the modules' jobs together)."""

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

ENGINE_LAYERS = {
    "process": 8,  # server, launch, zygote, start timing, serving flags
    "http": 7,  # app, routes, service, OpenAI, streaming, uvicorn, R-Fork's destination (drives service)
    "model": 6,  # the runner on one tp rank: runs the weight updates, LoRA and the KV cache's forward
    "weights": 5,  # updates, groups, storages, load prints, R-Fork's rank side; sessions hold the scheduler
    "lora": 4,  # adapters, merge on activation (the weight updates reach the parameters through it)
    "runtime": 3,  # rank 0's scheduler, its dense step, aborts, pausing, stepping, admission
    "kv": 2,  # the paged KV cache (its steps use the sequences and lockstep)
    "sequences": 1,  # samples, sampling, logprobs, stops, which samples batch together
    "tp": 0, "__init__": 0,  # the tp ranks: lockstep, ranks, shards, payloads
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


def _engine_unit(module: str) -> str | None:
    """The engine subpackage of a dotted module name ("__init__" for rollfleet.engine); None outside the engine."""
    parts = module.split(".")
    if parts[:2] != ["rollfleet", "engine"]:
        return None
    return parts[2] if len(parts) > 2 else "__init__"


def _submodules(path: Path, root: Path) -> list[tuple[int, str]]:
    """`_imports`, where `from rollfleet.engine import x` names x when x is a module of the tree under `root`."""
    tree = ast.parse(path.read_text(), filename=str(path))
    extra = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                name = root / (node.module.replace(".", "/") + "/" + alias.name)
                if name.is_dir() or name.with_suffix(".py").is_file():
                    extra.append((node.lineno, f"{node.module}.{alias.name}"))
    return _imports(path) + extra


def _engine_violations(root: Path = PACKAGE.parent) -> list[str]:
    """Imports between the engine's subpackages against ENGINE_LAYERS, for the tree under `root`."""
    bad = []
    for path in sorted((root / "rollfleet" / "engine").rglob("*.py")):
        relative = path.relative_to(root).with_suffix("")
        source = _engine_unit(".".join(relative.parts))
        if source not in ENGINE_LAYERS:
            bad.append(f"{relative}: put it in a subpackage of ENGINE_LAYERS in tests/test_imports.py")
            continue
        for line, module in _submodules(path, root):
            target = _engine_unit(module)
            if target is None or target == source:
                continue
            if target not in ENGINE_LAYERS:
                bad.append(f"{relative}:{line} imports {module}: unknown engine subpackage {target!r}")
            elif ENGINE_LAYERS[target] >= ENGINE_LAYERS[source] and target != "__init__":
                way = "sideways" if ENGINE_LAYERS[target] == ENGINE_LAYERS[source] else "up"
                bad.append(f"{relative}:{line} imports {module} ({way}: engine.{source} -> engine.{target})")
    return bad


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


def _module_edges(path: Path, root: Path) -> list[tuple[int, str]]:
    """The rollfleet modules `path` imports (line, dotted name): `from p import m` names p.m when m is a
    module of the tree under `root` (and then not p), else p; a package is its __init__."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                module, where = f"{node.module}.{alias.name}", root / node.module.replace(".", "/") / alias.name
                is_module = where.is_dir() or where.with_suffix(".py").is_file()
                found.append((node.lineno, module if is_module else node.module))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
    found = list(dict.fromkeys(found))  # `from m import a, b` is one arrow
    return [(line, name) for line, name in found if name == "rollfleet" or name.startswith("rollfleet.")]


def _module_graph(root: Path) -> dict[str, list[tuple[int, str]]]:
    """Every module under `root`/rollfleet (a package named by its dotted name) -> the modules of the
    tree it imports, with the line."""
    paths = {}
    for path in sorted((root / "rollfleet").rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        paths[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return {
        name: [(line, target) for line, target in _module_edges(path, root) if target in paths and target != name]
        for name, path in paths.items()
    }


def _circles(root: Path = PACKAGE.parent) -> list[str]:
    """Each circle of imports among the modules under `root` (a strongly connected set of modules,
    Tarjan's algorithm), as the imports inside it: the arrows to cut."""
    graph = _module_graph(root)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for _, target in graph[module]:
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            members = stack[stack.index(module) :]
            del stack[stack.index(module) :]
            if len(members) > 1:
                circles.append(sorted(members))

    for module in graph:
        if module not in index:
            visit(module)
    return [
        "circle of "
        + ", ".join(members)
        + ": "
        + "; ".join(f"{m}:{line} imports {t}" for m in members for line, t in graph[m] if t in members)
        for members in sorted(circles)
    ]


def test_imports_run_one_way():
    bad = _violations()
    assert not bad, "imports against the layers:\n" + "\n".join(bad)


def test_imports_inside_the_engine_run_one_way():
    bad = _engine_violations()
    assert not bad, "imports against the engine's layers (ENGINE_LAYERS):\n" + "\n".join(bad)


def test_the_engine_check_sees_imports_up_and_flat_modules(tmp_path):
    engine = tmp_path / "rollfleet" / "engine"
    for package in ("tp", "kv", "http", "weights", "lora"):
        (engine / package).mkdir(parents=True)
        (engine / package / "__init__.py").write_text("")
    (engine / "__init__.py").write_text("")
    (engine / "http" / "app.py").write_text("from rollfleet.engine.tp import lockstep\n")  # down: fine
    (engine / "kv" / "steps.py").write_text("def f():\n    from rollfleet.engine.http.app import x\n")
    (engine / "lora" / "merge.py").write_text("from rollfleet.engine import weights\n")
    (engine / "flat.py").write_text("")
    assert _engine_violations(tmp_path) == [
        "rollfleet/engine/flat: put it in a subpackage of ENGINE_LAYERS in tests/test_imports.py",
        "rollfleet/engine/kv/steps:2 imports rollfleet.engine.http.app (up: engine.kv -> engine.http)",
        "rollfleet/engine/lora/merge:1 imports rollfleet.engine.weights (up: engine.lora -> engine.weights)",
    ]


def test_no_circle_of_imports_inside_a_package_or_across_packages():
    bad = _circles()
    assert not bad, "imports in a circle (pass the helpers what they need instead):\n" + "\n".join(bad)


def test_the_circle_check_sees_type_checking_imports_and_circles_through_a_package(tmp_path):
    package = tmp_path / "rollfleet" / "pkg"
    package.mkdir(parents=True)
    (tmp_path / "rollfleet" / "__init__.py").write_text("")
    (package / "__init__.py").write_text("from rollfleet.pkg.top import Top\n")
    (package / "top.py").write_text("from rollfleet.pkg import helper\n")  # a module, not the package
    (package / "helper.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from rollfleet.pkg.top import Top\n"
    )
    (package / "low.py").write_text("from rollfleet.pkg.helper import x\n")  # down only: no circle
    (package / "sub.py").write_text("def f():\n    from rollfleet.pkg import Top\n")  # the package's name
    (package / "top2.py").write_text("import rollfleet.pkg.sub\n")
    assert _circles(tmp_path) == [
        "circle of rollfleet.pkg.helper, rollfleet.pkg.top: "
        "rollfleet.pkg.helper:3 imports rollfleet.pkg.top; rollfleet.pkg.top:1 imports rollfleet.pkg.helper",
    ]
    (package / "top.py").write_text("from rollfleet.pkg import helper, top2\n")  # top -> top2 -> sub -> pkg -> top
    assert _circles(tmp_path)[0] == (
        "circle of rollfleet.pkg, rollfleet.pkg.helper, rollfleet.pkg.sub, rollfleet.pkg.top, rollfleet.pkg.top2: "
        "rollfleet.pkg:1 imports rollfleet.pkg.top; rollfleet.pkg.helper:3 imports rollfleet.pkg.top; "
        "rollfleet.pkg.sub:2 imports rollfleet.pkg; rollfleet.pkg.top:1 imports rollfleet.pkg.helper; "
        "rollfleet.pkg.top:1 imports rollfleet.pkg.top2; rollfleet.pkg.top2:1 imports rollfleet.pkg.sub"
    )


def test_the_check_sees_function_level_imports(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from rollfleet.fleet.fleet import Fleet\n")
    assert _imports(module) == [(2, "rollfleet.fleet.fleet")]


MODULE_LINES = 350  # past it, a module says in its opening docstring why it is one job (after ONE_JOB)
MODULE_LINES_CEILING = 400  # past it, no reason holds: cut the module
ONE_JOB = "One job:"


def _too_long(name: str, text: str) -> list[str]:
    """What is too long in the module `name` with source `text`: itself, its functions; [] when nothing is."""
    found = []
    lines, tree = len(text.splitlines()), ast.parse(text)
    explained = ONE_JOB in (ast.get_docstring(tree, clean=False) or "")
    if lines > MODULE_LINES_CEILING:
        found.append(f"{name}: {lines} lines")
    elif lines > MODULE_LINES and not explained:
        found.append(f"{name}: {lines} lines (cut it where its jobs part, or say why it is one: {ONE_JOB!r})")
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno >= 60:
            found.append(f"{name}:{node.lineno} {node.name}: {node.end_lineno - node.lineno + 1} lines")
    return found


def test_no_module_over_350_lines_unless_one_job_and_no_function_over_60():
    """A newcomer reads one job per module and one step per function (docs/architecture.md): a module past
    MODULE_LINES is cut where its jobs part, or its opening docstring says, after ONE_JOB, why it is one."""
    too_long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        too_long += _too_long(str(path.relative_to(PACKAGE.parent)), path.read_text())
    assert not too_long, "split these:\n" + "\n".join(too_long)


def test_the_length_check_reads_the_one_job_sentence():
    body = "x = 1\n" * MODULE_LINES
    assert _too_long("plain.py", '"""A module."""\n' + body) == [
        f"plain.py: {MODULE_LINES + 1} lines (cut it where its jobs part, or say why it is one: {ONE_JOB!r})"
    ]
    assert _too_long("explained.py", f'"""A module.\n\n{ONE_JOB} one state machine."""\n' + body) == []
    assert _too_long("short.py", '"""A module."""\n' + "x = 1\n" * (MODULE_LINES - 1)) == []
    huge = f'"""{ONE_JOB} all of it."""\n' + "x = 1\n" * MODULE_LINES_CEILING
    assert _too_long("huge.py", huge) == [f"huge.py: {MODULE_LINES_CEILING + 1} lines"]
    long_function = "def f():\n" + "    x = 1\n" * 60
    assert _too_long("f.py", long_function) == ["f.py:1 f: 61 lines"]
