"""What an engine call raises: EngineError with the HTTP status and the server's own message,
EngineTimeout when no answer came in time, EngineUnreachable when none could come (the connection
was refused, reset or closed under the request: the engine's process died or stopped)."""

from __future__ import annotations

import json

# in the 400 of an embedded engine's resume its device cannot back (engine/model/model.py, resume_refusal);
# the fleet tells that refusal from others by it (fleet/colocation.py)
RESUME_REFUSED = "refused, nothing changed: it needs"


class EngineUnreachable(ConnectionError):
    def __init__(self, route: str, base_url: str, cause: BaseException):
        super().__init__(f"{route} on {base_url}: no answer could be read ({cause!r})")
        self.route, self.base_url, self.cause = route, base_url, cause


class EngineError(RuntimeError):
    def __init__(self, route: str, status_code: int, message: str):
        super().__init__(f"{route} -> HTTP {status_code}: {message}")
        self.route, self.status_code, self.message = route, status_code, message


class EngineTimeout(EngineError):
    pass


def message_of(content: bytes) -> str:
    """The server's own message in an error answer's body (SGLang's and OpenAI's shapes), else the body."""
    try:
        body = json.loads(content)
    except ValueError:
        return content.decode("utf-8", "replace")
    if isinstance(body, dict):
        error = body.get("error")
        return body.get("message") or (error.get("message") if isinstance(error, dict) else error) or str(body)
    return str(body)
