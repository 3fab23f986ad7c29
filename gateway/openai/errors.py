"""The one translation of the gateway's errors to OpenAI error bodies, and the app's handlers
that apply it to every failure: gateway errors, bad bodies, unknown routes, bugs."""

from __future__ import annotations

import structlog
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway import protocol as p
from gateway.errors import (
    DeadlineExceeded,
    GatewayError,
    InvalidRequest,
    ModelNotFound,
    ReadoutFailed,
    Unavailable,
)

log = structlog.get_logger("gateway.http")


def openai_error(error: GatewayError) -> tuple[int, p.ErrorResponse]:
    """The one translation of the gateway error tree to an HTTP status and OpenAI body."""
    if isinstance(error, InvalidRequest):
        detail = p.ErrorDetail(
            message=error.message, type="invalid_request_error", param=error.param, code=error.code
        )
        return (404 if isinstance(error, ModelNotFound) else 400), p.ErrorResponse(error=detail)
    if isinstance(error, DeadlineExceeded):
        status, kind, code = 504, "timeout_error", "deadline_exceeded"
    elif isinstance(error, Unavailable):
        status, kind, code = 503, "service_unavailable_error", "unavailable"
    elif isinstance(error, ReadoutFailed):
        status, kind, code = 500, "server_error", "readout_failed"
    else:
        status, kind, code = 500, "server_error", None
    return status, p.ErrorResponse(error=p.ErrorDetail(message=str(error), type=kind, code=code))


def validation_error(exc: RequestValidationError) -> InvalidRequest:
    """A body pydantic refused, as an InvalidRequest naming its first bad field."""
    first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
    if first.get("type") == "json_invalid":
        return InvalidRequest(
            f"The body is not valid JSON: {first.get('msg')}.", None, "invalid_json"
        )
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    # pydantic reports a union member's type in the path (prompt.str); the field is enough
    param = loc[0] if loc else None
    where = ".".join(loc)
    return InvalidRequest(f"{where}: {first.get('msg')}" if where else str(first.get("msg")), param)


def _json(status: int, body: BaseModel, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(status_code=status, content=body.model_dump(), headers=headers)


async def _on_gateway_error(_request: Request, exc: GatewayError) -> JSONResponse:
    return _json(*openai_error(exc))


async def _on_validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
    return _json(*openai_error(validation_error(exc)))


async def _on_http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
    # unknown routes (404), wrong methods (405): the OpenAI shape, not FastAPI's {"detail"}
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    detail = p.ErrorDetail(message=str(exc.detail), type=kind, code=str(exc.status_code))
    return _json(exc.status_code, p.ErrorResponse(error=detail), getattr(exc, "headers", None))


async def _on_bug(_request: Request, exc: Exception) -> JSONResponse:
    # a bug still answers in the OpenAI shape; the traceback goes to the log, not the body
    log.exception("unhandled error", error=type(exc).__name__)
    detail = p.ErrorDetail(message="internal error", type="server_error", code="internal")
    return _json(500, p.ErrorResponse(error=detail))


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(GatewayError, _on_gateway_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    app.add_exception_handler(Exception, _on_bug)
