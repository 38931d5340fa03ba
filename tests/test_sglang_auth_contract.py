"""Who may call which route, against SGLang's own code in .sglang-site (`make sglang-site`): its
route table (the `@auth_level(...)` marks of srt/entrypoints/http_server.py, read from the source) and
its `decide_request_auth` (srt/utils/auth.py, loaded as a file: it imports nothing of SGLang) must
decide every route of the embedded engine, every key setting and every header as rollfleet.wire.auth
does. Skipped, with the reason, only when the wheel is not installed."""

from __future__ import annotations

import ast
import importlib.util
import itertools
import os
import sys
from pathlib import Path

import pytest

from rollfleet.engine.http.app import ROUTE_MODULES
from rollfleet.wire.auth import ROLLFLEET_PREFIX, SGLANG_ADMIN_ROUTES, is_admin_route, key_for, refusal

ROOT = Path(__file__).resolve().parent.parent
SITE = Path(os.environ.get("ROLLFLEET_SGLANG_SITE") or ROOT / ".sglang-site").resolve()
# routes of the embedded engine that SGLang 0.5.23's http_server does not declare
NOT_IN_SGLANGS_TABLE = {
    "/get_weight_version",  # removed in 0.5.21; slime's engine wrapper still reads it
    "/v1/loads",  # served by SGLang's OpenAI side, not declared in http_server.py
}
KEYS = [(None, None), ("api", None), (None, "adm"), ("api", "adm"), ("same", "same")]
HEADERS = [None, "", "Bearer api", "bearer adm", "BEARER same", "Basic adm", "Bearer wrong", "Bearer  api", "Bearer"]


def _sglang_file(relative: str) -> Path:
    path = SITE / "sglang" / relative
    if not path.exists():
        pytest.skip(f"the sglang wheel is not installed in {SITE}: run `make sglang-site` (needs the package registry)")
    return path


@pytest.fixture(scope="module")
def sglang_auth():
    spec = importlib.util.spec_from_file_location("sglang_auth", _sglang_file("srt/utils/auth.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


@pytest.fixture(scope="module")
def sglang_levels() -> dict[str, str]:
    """path -> auth level of every route SGLang's http_server declares with `@app.<method>(path)`."""
    levels = {}
    tree = ast.parse(_sglang_file("srt/entrypoints/http_server.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            paths, level = [], "normal"
            for mark in node.decorator_list:
                if not isinstance(mark, ast.Call):
                    continue
                if isinstance(mark.func, ast.Attribute) and getattr(mark.func.value, "id", None) == "app":
                    paths += [mark.args[0].value] if mark.args and isinstance(mark.args[0], ast.Constant) else []
                elif getattr(mark.func, "id", None) == "auth_level":
                    level = mark.args[0].attr.lower()
            levels.update(dict.fromkeys(paths, level))
    assert len(levels) > 50, f"read only {len(levels)} routes from SGLang's http_server: has its layout changed?"
    return levels


def our_routes() -> set[tuple[str, str]]:
    return {
        (method, route.path) for module in ROUTE_MODULES for route in module.router.routes for method in route.methods
    }


def test_every_route_has_sglangs_level(sglang_levels):
    paths = {path for _, path in our_routes()}
    assert SGLANG_ADMIN_ROUTES <= paths, "the table names a route the engine does not serve"
    unknown = {p for p in paths - set(sglang_levels) if not p.startswith(ROLLFLEET_PREFIX)}
    assert unknown == NOT_IN_SGLANGS_TABLE
    for path in sorted(paths & set(sglang_levels)):
        assert is_admin_route(path) == (sglang_levels[path] == "admin_optional"), (path, sglang_levels[path])
    assert all(is_admin_route(p) for p in paths if p.startswith(ROLLFLEET_PREFIX))


def test_sglangs_decide_request_auth_agrees_on_every_route_key_and_header(sglang_auth, sglang_levels):
    level_of = {"normal": sglang_auth.AuthLevel.NORMAL, "admin_optional": sglang_auth.AuthLevel.ADMIN_OPTIONAL}
    requests = sorted(our_routes()) + [("OPTIONS", "/generate"), ("GET", "/metrics"), ("OPTIONS", "/abort_request")]
    checked = 0
    for (method, path), (api_key, admin_key), header in itertools.product(requests, KEYS, HEADERS):
        level = sglang_levels.get(path, "admin_optional" if is_admin_route(path) else "normal")
        theirs = sglang_auth.decide_request_auth(
            method=method,
            path=path,
            authorization_header=header,
            api_key=api_key,
            admin_api_key=admin_key,
            auth_level=level_of[level],
        )
        ours = refusal(method, path, header, api_key=api_key, admin_api_key=admin_key)
        assert theirs.allowed == (ours is None), (method, path, api_key, admin_key, header, ours)
        assert theirs.allowed or theirs.error_status_code == 401  # the status the embedded engine answers
        if api_key or admin_key:  # the key the client sends opens the route
            sent = key_for(path, api_key, admin_key)
            assert refusal(method, path, sent and f"Bearer {sent}", api_key=api_key, admin_api_key=admin_key) is None
        checked += 1
    assert checked == len(requests) * len(KEYS) * len(HEADERS)
