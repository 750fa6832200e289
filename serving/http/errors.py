"""The one place exceptions become OpenAI-style error JSON: `to_api_error` maps any exception raised while
serving a request, `handle_error` answers it (the app registers it for every type in MAPPED_ERRORS and for
Exception), and a full disk or read-only data dir marks /health degraded."""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Iterable
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import BaseRoute, Match
from starlette.types import Scope

from kvmem.errors import DependencyUnavailable
from kvmem.text import InvalidMemoryInput, MemoryNotFound, TextStoreError
from serving.backends.base import BackendError, NotReady, PoolFull, PoolTooSmall, PromptTooLong, QueueFull
from serving.http.limits import BodyTimeout, BodyTooLarge
from serving.http.protocol import NON_BLANK, ApiError, bad_request
from serving.http.storage import storage_failure

logger = logging.getLogger("serving.http.app")

RETRY_AFTER_S = 1  # what a 429 tells the client to wait (the queue or the KV pool was full)


def error_response(error: ApiError) -> JSONResponse:
    headers = {
        **(error.headers or {}),
        **({"Retry-After": str(RETRY_AFTER_S)} if error.status == 429 else {}),
    }
    return JSONResponse(error.to_dict(), status_code=error.status, headers=headers or None)


def allowed_methods(routes: Iterable[BaseRoute], scope: Scope) -> str:
    """The `Allow` of a 405: the methods of every route whose path matches the request's. Starlette's own names
    only the first such route's, and FastAPI makes a route per method (GET and DELETE /v1/memories are two)."""
    methods: set[str] = set()
    for route in routes:
        match, _ = route.matches(scope)
        if match is not Match.NONE:
            methods |= getattr(route, "methods", None) or set()
    return ", ".join(sorted(methods))


def to_api_error(exc: Exception) -> ApiError:
    """Map any exception raised while serving a request to its OpenAI-style error."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, RequestValidationError):
        if isinstance(exc.body, bytes):  # FastAPI parses a body as JSON only when its Content-Type says JSON
            return ApiError(
                415,
                "the request body must be JSON sent with Content-Type: application/json",
                type="invalid_request_error",
                code="unsupported_media_type",
            )
        errors = exc.errors()
        first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
        if first.get("type") == "json_invalid":
            return _invalid_json(_where_in_json(exc.body, first))
        loc = [str(p) for p in first.get("loc", ())]
        if loc and loc[0] in (
            "body",
            "query",
            "path",
            "header",
            "cookie",
        ):  # where in the request, not a name
            loc = loc[1:]  # (a body field named `query` keeps its name)
        where = ".".join(loc)
        message = _validation_message(first)
        message = f"{where}: {message}" if where else message
        return bad_request(f"invalid request: {message}", param=where or None, code="invalid_value")
    if isinstance(exc, StarletteHTTPException) and isinstance(exc.__cause__, UnicodeDecodeError):
        cause = exc.__cause__  # FastAPI's "There was an error parsing the body": JSON must be UTF-8
        return _invalid_json(f"not UTF-8 (byte 0x{cause.object[cause.start]:02x} at position {cause.start})")
    if isinstance(exc, StarletteHTTPException) and isinstance(exc.__cause__, RecursionError):
        return _invalid_json("arrays and objects nested too deeply to parse")
    if isinstance(exc, StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return ApiError(
            exc.status_code, str(exc.detail), type="invalid_request_error", code=code, headers=exc.headers
        )
    if isinstance(exc, BodyTooLarge):
        return ApiError(413, str(exc), type="invalid_request_error", code="request_too_large")
    if isinstance(exc, BodyTimeout):
        return ApiError(408, str(exc), type="invalid_request_error", code="request_timeout")
    if isinstance(exc, PromptTooLong):
        return bad_request(str(exc), param="messages", code="context_length_exceeded")
    if isinstance(exc, PoolTooSmall):  # never fits, however long it waits: not a 429 to retry
        return bad_request(str(exc), param="max_tokens", code="kv_pool_too_small")
    if isinstance(exc, QueueFull | PoolFull):
        code = "kv_pool_full" if isinstance(exc, PoolFull) else "queue_full"
        return ApiError(429, f"server busy: {exc}; retry later", type="rate_limit_error", code=code)
    if isinstance(exc, NotReady):
        return ApiError(
            503, f"the model is not ready: {exc}", type="service_unavailable", code="model_not_ready"
        )
    if isinstance(exc, DependencyUnavailable):
        return ApiError(503, str(exc), type="service_unavailable", code="dependency_unavailable")
    if isinstance(exc, MemoryNotFound):
        return ApiError(404, "memory not found", type="invalid_request_error", code="memory_not_found")
    if isinstance(exc, InvalidMemoryInput):
        return bad_request(str(exc), code="invalid_memory")
    what = storage_failure(exc)
    if what is not None:  # a full disk or a read-only data dir: say so, not "internal error"
        logger.error("storage failure: %s", what)
        return ApiError(
            507,
            f"insufficient storage: a write to the data dir failed: {what}",
            type="server_error",
            code="insufficient_storage",
        )
    if isinstance(exc, (BackendError, TextStoreError)):
        logger.error("request failed: %r", exc)
        return ApiError(
            500, f"internal error: {type(exc).__name__}", type="server_error", code="internal_error"
        )
    logger.exception("unexpected error", exc_info=exc)
    return ApiError(500, "internal error", type="server_error", code="internal_error")


def _validation_message(error: dict[str, Any]) -> str:
    """Pydantic's message for one validation error, said plainly where it is not: a blank string (the NON_BLANK
    pattern) and a model validator's ValueError (without pydantic's "Value error, ")."""
    msg = str(error.get("msg"))
    if error.get("type") == "string_pattern_mismatch" and error.get("ctx", {}).get("pattern") == NON_BLANK:
        return "must not be empty or only whitespace"
    if error.get("type") == "value_error":
        return msg.removeprefix("Value error, ")
    return msg


def _invalid_json(where: str) -> ApiError:
    return bad_request(f"the request body is not valid JSON: {where}", code="invalid_json")


def _where_in_json(doc: Any, error: dict[str, Any]) -> str:
    """What the JSON parser found wrong and where, as Python's JSONDecodeError says it: `msg at line L column C
    (char N)`, from FastAPI's json_invalid error (its loc ends with the character position) and the text."""
    msg = str(error.get("ctx", {}).get("error") or "invalid JSON")
    pos = error.get("loc", ())[-1] if error.get("loc") else None
    if not isinstance(doc, str) or not isinstance(pos, int):
        return msg
    line = doc.count("\n", 0, pos) + 1
    column = pos - doc.rfind("\n", 0, pos)
    return f"{msg} at line {line} column {column} (char {pos})"


MAPPED_ERRORS = (
    ApiError,
    RequestValidationError,
    StarletteHTTPException,
    PromptTooLong,
    QueueFull,
    PoolFull,
    PoolTooSmall,
    NotReady,
    BackendError,
    MemoryNotFound,
    DependencyUnavailable,
    InvalidMemoryInput,
    TextStoreError,
    sqlite3.Error,  # a full disk, a read-only store (507) or else a 500, answered without a re-raise
    OSError,
)


async def handle_error(request: Request, exc: Exception) -> JSONResponse:
    error = to_api_error(exc)
    if error.status == 405:
        error.headers = {
            **(error.headers or {}),
            "Allow": allowed_methods(request.app.router.routes, request.scope),
        }
    if error.code == "insufficient_storage":  # /health says degraded until a write succeeds
        request.app.state.storage_health.failed(error.message)
    return error_response(error)
