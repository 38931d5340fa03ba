"""The embedded engine's HTTP app (SGLang's route names, fields and response shapes): the routes of
rollfleet.engine.routes over one EngineService, an API-key check, and errors as
`{"success": false, "message": ...}` with a 4xx status.
"""

from __future__ import annotations

import secrets

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from rollfleet.engine.openai_api import error_body
from rollfleet.engine.routes import control, generate, lora, openai, remote, weights
from rollfleet.engine.service import VERSION, BadRequest, EngineService, fail, validation_message


def create_app(engine: EngineService) -> FastAPI:
    app = FastAPI(title="rollfleet embedded engine", version=VERSION)
    app.state.engine = engine
    for module in (generate, weights, lora, control, remote, openai):
        app.include_router(module.router)
    app.middleware("http")(require_api_key)
    app.exception_handler(RequestValidationError)(on_invalid_request)
    app.exception_handler(BadRequest)(on_bad_request)
    app.exception_handler(StarletteHTTPException)(on_http_error)
    return app


async def require_api_key(request: Request, call_next):
    """SGLang's rule: with --api-key every request needs `Authorization: Bearer <key>` (the scheme
    in any case), except CORS preflights (OPTIONS) and the --api-key-open-paths (health probes)."""
    args = request.app.state.engine.args
    if args.api_key and request.method != "OPTIONS" and not request.url.path.startswith(tuple(args.api_key_open_paths)):
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(given.encode(), args.api_key.encode()):
            return fail("missing or wrong API key: send 'Authorization: Bearer <key>'", 401)
    return await call_next(request)


async def on_invalid_request(request: Request, exc: RequestValidationError):
    message = f"invalid request: {validation_message(exc)}"
    if request.url.path.startswith("/v1/"):  # the OpenAI routes answer in OpenAI's error shape
        return JSONResponse(error_body(message), status_code=400)
    if request.url.path in weights.UPDATE_ROUTES:  # a refused call fails an open weight-update session
        request.app.state.engine.sessions.after_refusal(request.url.path, message)
    return fail(message)


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
    if request.url.path.startswith("/v1/"):
        return JSONResponse(error_body(message, exc.status_code), status_code=exc.status_code, headers=exc.headers)
    response = fail(message, exc.status_code)
    response.headers.update(exc.headers or {})
    return response


async def on_bad_request(_request: Request, exc: BadRequest):
    return fail(exc.message, exc.status_code)
