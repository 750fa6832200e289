"""The OpenAPI document as the server behaves: request validation answers 400 with OpenAI error JSON, not
FastAPI's default 422 with its own `detail` shape.

Owns only the rewrite of the generated schema; the statuses themselves come from app.py's error mapping.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

ERROR_SCHEMA: dict[str, Any] = {
    "title": "Error",
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}
_ERROR_REF = {"$ref": "#/components/schemas/Error"}
_BAD_REQUEST = {
    "description": "Invalid request (OpenAI error JSON; `code` names the problem, `param` the field)",
    "content": {"application/json": {"schema": _ERROR_REF}},
}
_OTHER_ERRORS = {
    "description": "Any other error, as OpenAI error JSON (401, 403, 404, 408, 413, 429, 500, 503, 507)",
    "content": {"application/json": {"schema": _ERROR_REF}},
}
_METHODS = ("get", "put", "post", "delete", "options", "head", "patch", "trace")


def openapi_with_400(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema with every 422 replaced by 400 and the error shape; every operation documents 400
    (a malformed request or body gets it on any route) and a `default` error response. Cached on the app."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    for path_item in schema.get("paths", {}).values():
        for method, operation in path_item.items():
            if method not in _METHODS:
                continue
            responses = operation.setdefault("responses", {})
            responses.pop("422", None)
            responses["400"] = _BAD_REQUEST
            responses.setdefault("default", _OTHER_ERRORS)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for unused in ("HTTPValidationError", "ValidationError"):  # only the 422 responses named them
        components.pop(unused, None)
    components["Error"] = ERROR_SCHEMA
    app.openapi_schema = schema
    return schema
