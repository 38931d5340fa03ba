"""What an engine call raises: EngineError with the HTTP status and the server's own message."""

from __future__ import annotations

import httpx


class EngineError(RuntimeError):
    def __init__(self, route: str, status_code: int, message: str):
        super().__init__(f"{route} -> HTTP {status_code}: {message}")
        self.route, self.status_code, self.message = route, status_code, message


class EngineTimeout(EngineError):
    pass


def message_of(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text
    if isinstance(body, dict):
        error = body.get("error")
        return body.get("message") or (error.get("message") if isinstance(error, dict) else error) or str(body)
    return str(body)
