"""The HTTP side of rank 0: uvicorn with a hook for when its socket listens (the end of the engine's
start, start_timing.py), and the request body size limit in front of the app."""

from __future__ import annotations

import json


def run_server(app, args, *, on_listening) -> None:
    """uvicorn.run(app, host, port, log_level), calling `on_listening()` once the socket listens."""
    import uvicorn

    class Server(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets=sockets)
            if self.started:
                on_listening()

    Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level)).run()


class RequestBodyLimit:
    """ASGI middleware: a request body above `max_bytes` gets 413 before the app parses it, by its
    Content-Length; a body without one (chunked) is read here up to the limit, then handed on."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None:
            if not length.isdigit() or int(length) > self.max_bytes:
                return await self._refuse(send, f"content-length {length.decode('latin-1')!r}")
            return await self.app(scope, receive, send)
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
            if size > self.max_bytes:
                return await self._refuse(send, f"more than {self.max_bytes} bytes")
        body, handed = b"".join(chunks), False

        async def replay():
            nonlocal handed
            if handed:
                return await receive()  # waits for the disconnect
            handed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    async def _refuse(self, send, got: str) -> None:
        message = (
            f"request body: {got} is over this server's limit of {self.max_bytes} bytes: split the request "
            "(fewer prompts per call), or start the server with a larger --max-request-bytes"
        )
        body = json.dumps({"success": False, "message": message}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": body})
