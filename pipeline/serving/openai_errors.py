"""Every error of the OpenAI frontend in OpenAI's schema, `{"error": {"message", "type", "param", "code"}}`:
a refused field or malformed JSON is a 400 (never FastAPI's 422), a bug of ours a 500 (the server keeps
serving), an unknown route a 404."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from pipeline.serving.error_kinds import ErrorKind, internal_error
from pipeline.serving.openai_schema import RequestError


def error_body(message: str, type_: str = "invalid_request_error", param=None, code=None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


RETRY_AFTER_S = (
    "1"  # what a 503 tells its client to wait before retrying (draining, out of memory, Triton gone)
)


def error_response(status: int, message: str, param=None, code=None) -> JSONResponse:
    type_ = "invalid_request_error" if status < 500 else "server_error"
    headers = {"retry-after": RETRY_AFTER_S} if status == 503 else None
    return JSONResponse(error_body(message, type_, param, code), status_code=status, headers=headers)


def validation_message(e: ValidationError) -> tuple[str, str | None]:
    """The first problem as (message, param): the param is the top-level field (the full path is in the
    message; a union's path also names the member type pydantic tried)."""
    err = e.errors()[0]
    param = str(err["loc"][0]) if err["loc"] else None
    where = ".".join(str(p) for p in err["loc"])
    if err["type"] == "extra_forbidden":
        return f"unknown field '{where}' (this server does not support it)", param
    if err["type"] == "missing":
        return f"'{where}' is required", param
    return f"'{where}': {err['msg']}", param


async def _request_error(request: Request, e: RequestError) -> JSONResponse:
    return error_response(e.status, e.message, e.param, e.code)


async def _validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
    return error_response(400, f"invalid request: {e.errors()[0].get('msg', e)}")


async def _unexpected(request: Request, e: Exception) -> JSONResponse:
    # a bug of ours, still in OpenAI's schema (uvicorn logs the traceback); the server keeps serving
    internal = ErrorKind.INTERNAL
    return error_response(internal.status, internal_error("in the frontend", e), code=internal.code)


async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
    return error_response(e.status_code, str(e.detail), code="not_found" if e.status_code == 404 else None)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(RequestError, _request_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(Exception, _unexpected)
    app.add_exception_handler(StarletteHTTPException, _http_error)
