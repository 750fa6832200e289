"""Request-size limits at the HTTP edge: the body-size middleware, and the checks of parsed requests.

Owns how each limit of `Limits` (serving/config.py) is counted and the error that names the field, its size
and the limit: BodyTooLarge for the body (413), an ApiError 400 for the rest. app.py maps them to error
JSON. Also bounds how long a body may take to arrive (BodyTimeout, 408): a client that sends part of a body
and stalls would otherwise hold a connection and a task forever. Knows nothing of routes, backends or storage.
"""

from __future__ import annotations

import asyncio
import json
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvmem.text.filters import MAX_METADATA_DEPTH, json_depth
from serving.config import Limits
from serving.http.protocol import (
    AddMemoriesRequest,
    ApiError,
    ChatCompletionRequest,
    SearchMemoriesRequest,
    UpdateMemoryRequest,
    bad_request,
)


class BodyTooLarge(Exception):
    """A request body over `Limits.max_body_bytes` (HTTP 413). num_bytes: its declared Content-Length, or None
    when it was counted while streaming in and refused once past the limit."""

    def __init__(self, limit_bytes: int, num_bytes: int | None) -> None:
        if num_bytes is None:
            message = f"the request body is over the limit of {limit_bytes} bytes (max_body_bytes)"
        else:
            message = (
                f"the request body has {num_bytes} bytes, over the limit of {limit_bytes} (max_body_bytes)"
            )
        super().__init__(message)
        self.limit_bytes, self.num_bytes = limit_bytes, num_bytes


class BodyTimeout(Exception):
    """The request body did not arrive in full within `read_timeout_s` of the request's start (HTTP 408; the
    connection is closed after the answer)."""

    def __init__(self, timeout_s: float, num_bytes: int) -> None:
        super().__init__(
            f"the request body did not arrive within {timeout_s:g} s ({num_bytes} bytes received; "
            "read_timeout_s)"
        )
        self.timeout_s, self.num_bytes = timeout_s, num_bytes


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            return int(value) if value.isdigit() else None
    return None


class LimitBody:
    """ASGI middleware: a body over `max_body_bytes` is answered 413 before any route parses it, at once when
    its Content-Length says so, else as soon as the bytes received pass the limit (a chunked body declares no
    length, and a declared one is not trusted to be the truth). The body is read here, never more than the
    limit plus one chunk, and handed on unchanged; `respond` turns the BodyTooLarge into the response.

    The whole body must arrive within `read_timeout_s` of the request's start, else BodyTimeout (408, and the
    response asks the server to close the connection: the rest of the body is never read). uvicorn's
    keep-alive timeout covers only the idle time between requests, not a body that trickles or stalls."""

    def __init__(
        self,
        app: ASGIApp,
        max_body_bytes: int,
        respond: Callable[[Exception], ASGIApp],
        read_timeout_s: float = 30.0,
    ) -> None:
        assert read_timeout_s > 0, read_timeout_s
        self.app, self.max_body_bytes, self.respond = app, max_body_bytes, respond
        self.read_timeout_s = read_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_body_bytes:
            await self.respond(BodyTooLarge(self.max_body_bytes, declared))(scope, receive, send)
            return
        received: deque[Message] = deque()
        num_bytes = 0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.read_timeout_s
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0.0))
            except asyncio.TimeoutError:
                await self._refuse(BodyTimeout(self.read_timeout_s, num_bytes), scope, receive, send)
                return
            received.append(message)
            if message["type"] != "http.request":  # the client left: the app sees it as it would have
                break
            num_bytes += len(message.get("body", b""))
            if num_bytes > self.max_body_bytes:
                await self.respond(BodyTooLarge(self.max_body_bytes, None))(scope, receive, send)
                return
            if not message.get("more_body", False):
                break

        async def replay() -> Message:
            return received.popleft() if received else await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, exc: Exception, scope: Scope, receive: Receive, send: Send) -> None:
        """Answer `exc` with `Connection: close`: the unread rest of the body must not be taken as the next
        request."""

        async def closing(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
            await send(message)

        await self.respond(exc)(scope, receive, closing)


# -- parsed requests ---------------------------------------------------------------------------------------


def _too_long(param: str, num_chars: int, limit: int, name: str) -> ApiError:
    return bad_request(
        f"{param} has {num_chars} characters, over the limit of {limit} ({name})",
        param=param,
        code="string_above_max_length",
    )


def _too_many(param: str, num_items: int, limit: int, name: str) -> ApiError:
    return bad_request(
        f"{param} has {num_items} items, over the limit of {limit} ({name})",
        param=param,
        code="array_above_max_length",
    )


def _check_text(param: str, text: str | None, limit: int, name: str) -> None:
    if text is not None and len(text) > limit:
        raise _too_long(param, len(text), limit, name)


def _check_tags(param: str, tags: Sequence[str] | None, limits: Limits) -> None:
    if tags is None:
        return
    if len(tags) > limits.max_tags:
        raise _too_many(param, len(tags), limits.max_tags, "max_tags")
    for i, tag in enumerate(tags):
        _check_text(f"{param}[{i}]", tag, limits.max_tag_chars, "max_tag_chars")


def _check_metadata(metadata: dict[str, Any] | None, limits: Limits) -> None:
    """Its depth (the store's bound, kvmem.text's MAX_METADATA_DEPTH: checked first, as JSON encoders recurse)
    and its size."""
    if metadata is None:
        return
    depth = json_depth(metadata)
    if depth > MAX_METADATA_DEPTH:
        raise bad_request(
            f"metadata is nested {depth} levels deep, over the limit of {MAX_METADATA_DEPTH} (max_metadata_depth)",
            param="metadata",
            code="object_above_max_depth",
        )
    num_bytes = len(json.dumps(metadata, ensure_ascii=False, separators=(",", ":")).encode("utf-8"))
    if num_bytes > limits.max_metadata_bytes:
        raise bad_request(
            f"metadata is {num_bytes} bytes as JSON, over the limit of {limits.max_metadata_bytes} "
            "(max_metadata_bytes)",
            param="metadata",
            code="object_above_max_size",
        )


def check_chat(body: ChatCompletionRequest, limits: Limits) -> None:
    """Message count and each message's length. Raises ApiError (400)."""
    if len(body.messages) > limits.max_messages:
        raise _too_many("messages", len(body.messages), limits.max_messages, "max_messages")
    for i, message in enumerate(body.messages):
        _check_text(f"messages[{i}].content", message.text(), limits.max_message_chars, "max_message_chars")


def check_add(body: AddMemoriesRequest, limits: Limits) -> None:
    """How many memories, each text, tags and metadata of POST /v1/memories. Raises ApiError (400)."""
    _check_text("text", body.text, limits.max_memory_text_chars, "max_memory_text_chars")
    if body.messages is not None:
        if len(body.messages) > limits.max_memories_per_add:
            raise _too_many(
                "messages", len(body.messages), limits.max_memories_per_add, "max_memories_per_add"
            )
        for i, message in enumerate(body.messages):
            _check_text(
                f"messages[{i}].content",
                message.content,
                limits.max_memory_text_chars,
                "max_memory_text_chars",
            )
    _check_tags("tags", body.tags, limits)
    _check_metadata(body.metadata, limits)


def check_search(body: SearchMemoriesRequest, limits: Limits) -> None:
    """The query's length and the filter's tags. Raises ApiError (400)."""
    _check_text("query", body.query, limits.max_query_chars, "max_query_chars")
    if body.filters is not None:
        _check_tags("filters.tags", body.filters.tags, limits)


def check_update(body: UpdateMemoryRequest, limits: Limits) -> None:
    """The new text, tags and metadata of PATCH /v1/memories/{id}. Raises ApiError (400)."""
    _check_text("text", body.text, limits.max_memory_text_chars, "max_memory_text_chars")
    _check_tags("tags", body.tags, limits)
    _check_metadata(body.metadata, limits)
