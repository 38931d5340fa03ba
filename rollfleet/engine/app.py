"""The embedded engine's HTTP app (SGLang's route names, fields and response shapes): the routes of
rollfleet.engine.routes over one EngineService, an API-key check, and errors as
`{"success": false, "message": ...}` with a 4xx status.
"""

from __future__ import annotations

import secrets

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError

from rollfleet.engine.routes import control, generate, lora, remote, weights
from rollfleet.engine.service import VERSION, BadRequest, EngineService, fail, validation_message


def create_app(engine: EngineService) -> FastAPI:
    app = FastAPI(title="rollfleet embedded engine", version=VERSION)
    app.state.engine = engine
    for module in (generate, weights, lora, control, remote):
        app.include_router(module.router)
    app.middleware("http")(require_api_key)
    app.exception_handler(RequestValidationError)(on_invalid_request)
    app.exception_handler(BadRequest)(on_bad_request)
    return app


async def require_api_key(request: Request, call_next):
    api_key = request.app.state.engine.args.api_key
    if api_key:
        given = request.headers.get("authorization", "")
        if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            return fail("missing or wrong API key: send 'Authorization: Bearer <key>'", 401)
    return await call_next(request)


async def on_invalid_request(request: Request, exc: RequestValidationError):
    message = f"invalid request: {validation_message(exc)}"
    if request.url.path in weights.UPDATE_ROUTES:  # a refused call fails an open weight-update session
        request.app.state.engine.sessions.after_refusal(request.url.path, message)
    return fail(message)


async def on_bad_request(_request: Request, exc: BadRequest):
    return fail(exc.message, exc.status_code)
