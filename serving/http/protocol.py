"""Wire formats: OpenAI chat request/response shapes, the memory routes' bodies, and the error type.

Pydantic models validate strictly (a string where a number belongs is a 400, not a coercion); unknown OpenAI
fields are ignored. The models carry the constraints the server enforces, so /openapi.json refuses what the
server refuses: those pydantic checks itself, and (as `json_schema_extra`) those a later check refuses with a
message of its own (ChatService.validate, the routes, the store). Response builders return plain dicts in exactly
OpenAI's shapes. No behaviour lives here.
"""

from __future__ import annotations

import math
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StringConstraints,
    WithJsonSchema,
    model_validator,
)

if TYPE_CHECKING:
    from scheduler import Plan

NON_BLANK = r"\S"  # a pattern: a character other than whitespace (the store refuses empty and blank strings)
NonBlank = Annotated[str, StringConstraints(min_length=1, pattern=NON_BLANK)]
NonEmpty = Annotated[str, StringConstraints(min_length=1, max_length=256, pattern=NON_BLANK)]  # a user id
# an ISO 8601 time, parsed by the store (kvmem.text.filters.parse_time, which names the field it refuses); the
# schema says RFC 3339 date-time, the ISO 8601 profile every client writes
Time = Annotated[str, WithJsonSchema({"type": "string", "format": "date-time"})]


def _integral(value: Any) -> Any:
    """A float with no fractional part as the int it is: JSON (and JSON Schema's "integer") does not tell 94.0 from
    94, and strict validation would refuse it. Anything else goes on to strict validation as it came."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


Int = Annotated[
    int, BeforeValidator(_integral)
]  # constraints go before the validator: Annotated[int, Field(..), ...]


class ApiError(Exception):
    """An error with its OpenAI-style status, type and code; the app turns it into error JSON."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        """`headers`: sent with the error (a 405's `Allow`)."""
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type, code, param
        self.headers = headers

    def to_dict(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, *, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, type="invalid_request_error", param=param, code=code)


def _reject_unencodable(value: Any) -> None:
    """Python's JSON parser admits lone surrogates (via escapes) and NaN/Infinity, which no store or response
    can encode back: refuse them at the door."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("numbers must be finite (no NaN or Infinity)")
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("strings must be valid Unicode (no lone surrogates)") from None
    elif isinstance(value, dict):
        for k, v in value.items():
            _reject_unencodable(k)
            _reject_unencodable(v)
    elif isinstance(value, list):
        for v in value:
            _reject_unencodable(v)


class _Strict(BaseModel):
    # python-re: patterns mean what they mean to the store's Python (str.strip's whitespace is re's \s)
    model_config = ConfigDict(strict=True, extra="ignore", regex_engine="python-re")

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        _reject_unencodable(data)
        return data


class ContentPart(_Strict):
    """A content part of any type, so an image or audio part reaches ChatService.validate and is refused
    there by name (400 unsupported_content) rather than as a schema mismatch; only "text" parts, with their
    text, are served (and documented)."""

    model_config = ConfigDict(json_schema_extra={"required": ["type", "text"]})

    type: Annotated[str, WithJsonSchema({"const": "text"})]
    text: Annotated[str | None, WithJsonSchema({"type": "string"})] = None


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text or "" for p in self.content)

    def to_plain(self) -> dict[str, str]:
        return {"role": "system" if self.role == "developer" else self.role, "content": self.text()}


class StreamOptions(_Strict):
    include_usage: bool | None = None


# a user message among the messages (ChatService.validate)
_HAS_USER = {"contains": {"type": "object", "properties": {"role": {"const": "user"}}, "required": ["role"]}}
_NULL = {"type": "null"}
# top_logprobs only with logprobs: true (openai_params.check_params)
_TOP_LOGPROBS_NEED_LOGPROBS = {
    "if": {"properties": {"top_logprobs": {"type": "integer"}}, "required": ["top_logprobs"]},
    "then": {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]},
}


class ChatCompletionRequest(_Strict):
    """The schema states, besides pydantic's own checks, what ChatService.validate and check_params refuse by
    name (tools, n, stop, seed, modalities, audio, response_format, logit_bias); a backend's own limits (its
    sampling features, vocabulary and context) are its own."""

    model_config = ConfigDict(json_schema_extra=_TOP_LOGPROBS_NEED_LOGPROBS)

    model: str
    messages: list[ChatMessage] = Field(min_length=1, json_schema_extra=_HAS_USER)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    max_tokens: Annotated[int, Field(ge=1), BeforeValidator(_integral)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1), BeforeValidator(_integral)] | None = None
    stop: Annotated[
        str | list[str] | None,
        WithJsonSchema(
            {
                "anyOf": [
                    {"type": "string", "maxLength": 64},
                    {"type": "array", "items": {"type": "string", "maxLength": 64}, "maxItems": 4},
                    _NULL,
                ]
            }
        ),
    ] = None  # serving.chat.service: MAX_STOP_STRINGS, MAX_STOP_CHARS
    seed: Annotated[
        Int | None,
        WithJsonSchema({"anyOf": [{"type": "integer", "minimum": -(2**63), "maximum": 2**64 - 1}, _NULL]}),
    ] = None  # SEED_RANGE
    n: Annotated[Int | None, WithJsonSchema({"anyOf": [{"const": 1}, _NULL]})] = None  # only n=1
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = Field(default=None, max_length=256)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: Annotated[
        dict[str, float] | None,
        WithJsonSchema(
            {
                "anyOf": [
                    {
                        "type": "object",
                        "propertyNames": {"pattern": "^[0-9]+$"},
                        "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
                        "maxProperties": 300,
                    },
                    _NULL,
                ]
            }
        ),
    ] = None  # token id (a decimal string) -> bias in [-100, 100]
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20), BeforeValidator(_integral)] | None = None
    response_format: Annotated[
        dict[str, Any] | None,
        WithJsonSchema(
            {
                "anyOf": [
                    {
                        "type": "object",
                        "properties": {"type": {"enum": ["text", "json_object"]}},
                        "required": ["type"],
                    },
                    {
                        "type": "object",
                        "properties": {
                            "type": {"const": "json_schema"},
                            "json_schema": {
                                "type": "object",
                                "properties": {
                                    "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
                                    "schema": {"type": "object"},
                                    "strict": {"type": ["boolean", "null"]},
                                },
                                "required": ["name", "schema"],
                            },
                        },
                        "required": ["type", "json_schema"],
                    },
                    _NULL,
                ]
            }
        ),
    ] = None  # text, json_object, json_schema (serving/chat/openai_params.py response_format)
    # declared so that ChatService.validate refuses them by name instead of ignoring them (no tool calling):
    # documented as what is accepted, nothing (null, [] or "none")
    tools: Annotated[
        list[Any] | None, WithJsonSchema({"anyOf": [{"type": "array", "maxItems": 0}, _NULL]})
    ] = None
    tool_choice: Annotated[Any, WithJsonSchema({"enum": [None, [], "none"]})] = None
    functions: Annotated[
        list[Any] | None, WithJsonSchema({"anyOf": [{"type": "array", "maxItems": 0}, _NULL]})
    ] = None
    function_call: Annotated[Any, WithJsonSchema({"enum": [None, [], "none"]})] = None
    modalities: Annotated[
        list[str] | None, WithJsonSchema({"anyOf": [{"type": "array", "items": {"const": "text"}}, _NULL]})
    ] = None  # only ["text"] is served
    audio: Annotated[dict[str, Any] | None, WithJsonSchema(_NULL)] = None  # audio output: refused

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class MemoryMessage(_Strict):
    role: NonBlank
    content: NonBlank
    chat_time: Time | Annotated[str, StringConstraints(max_length=0)] | None = None  # "": the call's


class TimeRange(_Strict):
    """Inclusive bounds on chat_time (the store refuses an inverted range: a rule across fields, not stated)."""

    start: Time | None = None
    end: Time | None = None


class SearchFilters(_Strict):
    session_id: NonBlank | None = None
    tags: list[NonBlank] | None = None
    time_range: TimeRange | None = None


# exactly one of text and messages, each not null (the add route's check)
_TEXT_OR_MESSAGES = {
    "oneOf": [
        {"properties": {"text": {"type": "string"}}, "required": ["text"]},
        {"properties": {"messages": {"type": "array"}}, "required": ["messages"]},
    ]
}


class AddMemoriesRequest(_Strict):
    model_config = ConfigDict(json_schema_extra=_TEXT_OR_MESSAGES)

    user_id: NonEmpty
    session_id: NonBlank | None = None
    text: NonBlank | None = None
    messages: list[MemoryMessage] | None = Field(default=None, min_length=1)
    chat_time: Time | None = None
    tags: list[NonBlank] | None = None
    metadata: dict[str, Any] | None = None


class SearchMemoriesRequest(_Strict):
    user_id: NonEmpty
    query: NonBlank
    top_k: Int = Field(default=10, ge=1, le=100)
    filters: SearchFilters | None = None
    include_superseded: bool = False  # also memories a newer one superseded (for questions about the past)


class PrewarmRequest(_Strict):
    user_id: NonEmpty


# at least one of text, tags and metadata, not null (an update of nothing is refused)
_SOME_CHANGE = {
    "anyOf": [
        {"properties": {"text": {"type": "string"}}, "required": ["text"]},
        {"properties": {"tags": {"type": "array"}}, "required": ["tags"]},
        {"properties": {"metadata": {"type": "object"}}, "required": ["metadata"]},
    ]
}


class UpdateMemoryRequest(_Strict):
    model_config = ConfigDict(json_schema_extra=_SOME_CHANGE)

    user_id: NonEmpty
    text: NonBlank | None = None
    tags: list[NonBlank] | None = None
    metadata: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _changes_something(self) -> UpdateMemoryRequest:
        if self.text is None and self.tags is None and self.metadata is None:
            raise ValueError("give at least one of `text`, `tags` or `metadata`")
        return self


# -- response builders -------------------------------------------------------------------------------------


def usage_dict(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def logprobs_dict(entries: Any) -> dict[str, Any]:
    """A choice's `logprobs` in OpenAI's shape, from serving.backends.base.TokenLogprob entries."""
    return {
        "content": [
            {
                "token": e.token,
                "logprob": e.logprob,
                "bytes": list(e.bytes),
                "top_logprobs": [
                    {"token": t.token, "logprob": t.logprob, "bytes": list(t.bytes)} for t in e.top_logprobs
                ],
            }
            for e in entries
        ],
        "refusal": None,
    }


def completion_dict(
    *,
    completion_id: str,
    created: int,
    model: str,
    content: str,
    finish_reason: str,
    usage: dict[str, Any],
    memory: dict[str, Any],
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": content},
                "logprobs": logprobs,
                "finish_reason": finish_reason,
            }
        ],
        "usage": usage,
        "system_fingerprint": None,
        "memory": memory,
    }


def chunk_dict(
    *,
    completion_id: str,
    created: int,
    model: str,
    delta: dict[str, Any] | None,
    finish_reason: str | None = None,
    usage: dict[str, Any] | None = None,
    with_usage_field: bool = False,
    memory: dict[str, Any] | None = None,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One `chat.completion.chunk`. delta None makes the usage-only chunk (choices [])."""
    choices = (
        []
        if delta is None
        else [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]
    )
    out: dict[str, Any] = {
        "id": completion_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": choices,
        "system_fingerprint": None,
    }
    if with_usage_field or usage is not None:
        out["usage"] = usage
    if memory is not None:
        out["memory"] = memory
    return out


def plan_dict(plan: Plan) -> dict[str, Any]:
    """The `GET /v1/memories/plan` body for one plan."""
    block = plan.block
    return {
        "block": None
        if block is None
        else {
            "item_id": block.item_id,
            "memory_ids": list(block.memory_ids),
            "tokens": block.num_tokens,
            "bytes": block.num_bytes,
            "tier": "kv",
            "adapter": block.adapter,  # the served adapter name its K/V were computed under, or None
        },
        "adapter": None
        if plan.adapter is None
        else {
            "id": plan.adapter.adapter_id,
            "version": plan.adapter.version,
            "name": plan.adapter.name,
            "memory_ids": list(plan.adapter.memory_ids),  # served from it: not in the prompt
            "trained_ids": list(
                plan.adapter.trained_ids
            ),  # in its weights (those it did not fully recall too)
            "tier": "lora",
        },
        "updated_at": (
            None
            if plan.updated_at is None
            else datetime.fromtimestamp(plan.updated_at, timezone.utc).isoformat()
        ),
    }
