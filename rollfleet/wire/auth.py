"""Which key opens which route, as SGLang 0.5.23 decides it (`srt/utils/auth.py` `decide_request_auth`
over the routes its http_server marks `@auth_level(AuthLevel.ADMIN_OPTIONAL)`): the one table the
embedded server enforces and EngineClient follows (the admin key to admin routes, the API key to the
others), so that the fleet's control calls carry the admin key and its generate traffic the API key.

  - OPTIONS (CORS preflights) and the open paths (/health, /ready, /metrics, by prefix) need no key.
  - An admin route (weights, memory, pause / continue / abort, flush, LoRA loads, R-Fork sends; and
    every rollfleet extension under /rollfleet/) takes only the admin key when the server has one
    (the API key does not open it), else the API key, else nothing.
  - Any other route (generate, the OpenAI routes, status) takes the API key when the server has one,
    else nothing: a server with only an admin key leaves them open.

A refused call is 401 with SGLang's body `{"error": "Unauthorized"}`, plus this server's message naming
the fix. (SGLang answers 403 only on its ADMIN_FORCE routes, of which 0.5.23 has none.)
"""

from __future__ import annotations

import secrets

OPEN_PATHS = ("/health", "/ready", "/metrics")  # matched by prefix: /health_generate is open too
ROLLFLEET_PREFIX = "/rollfleet/"
# The routes of the embedded engine that SGLang 0.5.23 marks ADMIN_OPTIONAL (checked against its
# http_server in tests/test_sglang_auth_contract.py).
SGLANG_ADMIN_ROUTES = frozenset(
    {
        "/update_weights_from_disk",
        "/update_weights_from_tensor",
        "/update_weights_from_distributed",
        "/init_weights_update_group",
        "/destroy_weights_update_group",
        "/begin_weight_update",
        "/end_weight_update",
        "/update_weight_version",
        "/get_weights_by_name",
        "/release_memory_occupation",
        "/resume_memory_occupation",
        "/pause_generation",
        "/continue_generation",
        "/abort_request",
        "/flush_cache",
        "/load_lora_adapter",
        "/load_lora_adapter_from_tensors",
        "/unload_lora_adapter",
        "/init_weights_send_group_for_remote_instance",
        "/send_weights_to_remote_instance",
    }
)


def is_admin_route(path: str) -> bool:
    return path in SGLANG_ADMIN_ROUTES or path.startswith(ROLLFLEET_PREFIX)


def key_for(path: str, api_key: str | None, admin_api_key: str | None) -> str | None:
    """The key a client sends on `path` to a server started with these keys."""
    return (admin_api_key or api_key) if is_admin_route(path) else api_key


def refusal(
    method: str,
    path: str,
    authorization: str | None,
    *,
    api_key: str | None,
    admin_api_key: str | None,
    open_paths: tuple[str, ...] = OPEN_PATHS,
) -> str | None:
    """Why this request is refused (answered 401), or None when it may pass."""
    if method == "OPTIONS" or path.startswith(tuple(open_paths)):
        return None
    expected = key_for(path, api_key, admin_api_key)
    if expected is None or _bearer_matches(authorization, expected):
        return None
    if is_admin_route(path) and admin_api_key:
        return (
            f"{method} {path} is an admin route and this server has --admin-api-key: send "
            "'Authorization: Bearer <admin key>' (the --api-key does not open admin routes)"
        )
    return f"{method} {path}: missing or wrong API key: send 'Authorization: Bearer <key>' (the server's --api-key)"


def _bearer_matches(authorization: str | None, expected: str) -> bool:
    """`Bearer <key>` with the scheme in any case, the key compared in constant time."""
    scheme, _, given = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(given.encode(), expected.encode())
