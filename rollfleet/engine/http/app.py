"""The embedded engine's HTTP app (SGLang's route names, fields and response shapes): the routes of
rollfleet.engine.http.routes over one EngineService, SGLang's key check per route (rollfleet.wire.auth:
--api-key, --admin-api-key), and errors as `{"success": false, "message": ...}` with a 4xx status.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from rollfleet.engine.http.openai_api import error_body
from rollfleet.engine.http.routes import control, generate, lora, openai, remote, weights
from rollfleet.engine.http.service import VERSION, BadRequest, EngineService, fail, validation_message
from rollfleet.wire.auth import refusal

ROUTE_MODULES = (generate, weights, lora, control, remote, openai)


def create_app(engine: EngineService) -> FastAPI:
    app = FastAPI(title="rollfleet embedded engine", version=VERSION)
    app.state.engine = engine
    for module in ROUTE_MODULES:
        app.include_router(module.router)
    app.add_middleware(RequireApiKey)
    app.exception_handler(RequestValidationError)(on_invalid_request)
    app.exception_handler(BadRequest)(on_bad_request)
    app.exception_handler(StarletteHTTPException)(on_http_error)
    app.exception_handler(Exception)(on_unexpected_error)
    return app


class RequireApiKey:
    """ASGI middleware: SGLang's rule per route (rollfleet.wire.auth), the open paths being
    --api-key-open-paths; a refusal is SGLang's 401 `{"error": "Unauthorized"}` with this server's
    message naming the key to send. Plain ASGI: Starlette's `BaseHTTPMiddleware` (`app.middleware`)
    runs each request in a task group and streams its answer through a memory stream, a quarter of the
    event loop's time per /generate of 64 in flight."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        args = scope["app"].state.engine.args
        authorization = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"), None)
        why = refusal(
            scope["method"],
            scope["path"],
            authorization,
            api_key=args.api_key,
            admin_api_key=args.admin_api_key,
            open_paths=tuple(args.api_key_open_paths),
        )
        if why is None:
            return await self.app(scope, receive, send)
        answer = JSONResponse({"error": "Unauthorized", "success": False, "message": why}, status_code=401)
        await answer(scope, receive, send)


def error_answer(request: Request, message: str, status_code: int, headers=None) -> JSONResponse:
    """An error in the shape of the route's protocol: OpenAI's error object on /v1/, SGLang's
    `{"success": false, "message"}` elsewhere."""
    if request.url.path.startswith("/v1/"):
        return JSONResponse(error_body(message, status_code), status_code=status_code, headers=headers)
    response = fail(message, status_code)
    response.headers.update(headers or {})
    return response


async def on_invalid_request(request: Request, exc: RequestValidationError):
    message = f"invalid request: {validation_message(exc)}"
    if request.url.path in weights.UPDATE_ROUTES:  # a refused call fails an open weight-update session
        request.app.state.engine.sessions.after_refusal(request.url.path, message)
    return error_answer(request, message, 400)


HTTP_FIXES = {
    400: "send the body as one JSON object, UTF-8 encoded",  # FastAPI could not parse it
    404: "no such route on this server (it serves SGLang's routes and rollfleet's /rollfleet/ ones)",
    405: "use the method this route takes",
}


async def on_http_error(request: Request, exc: StarletteHTTPException):
    """FastAPI's own refusals (a body that is not JSON, an unknown route or method) in this server's error
    shape, naming the request and the fix, instead of `{"detail": ...}`."""
    allow = (exc.headers or {}).get("Allow")
    fix = f"use {allow}" if exc.status_code == 405 and allow else HTTP_FIXES.get(exc.status_code)
    message = f"{request.method} {request.url.path}: {exc.detail}" + (f": {fix}" if fix else "")
    return error_answer(request, message, exc.status_code, exc.headers)


async def on_unexpected_error(request: Request, exc: Exception):
    """A route's own failure (a bug: bad input is a 4xx before it): the client gets a JSON 500 naming
    the route and the error instead of a dropped connection; the traceback goes to the server's log
    (Starlette re-raises after this answer) and the server goes on serving."""
    message = (
        f"{request.method} {request.url.path}: internal error ({type(exc).__name__}: {str(exc)[:300]}); "
        "the server goes on serving: report it with the traceback in the engine's log"
    )
    return error_answer(request, message, 500)


async def on_bad_request(_request: Request, exc: BadRequest):
    return fail(exc.message, exc.status_code)
