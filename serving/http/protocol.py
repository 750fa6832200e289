"""Wire formats: OpenAI chat request/response shapes, the memory routes' bodies, and the error type.

Pydantic models validate strictly (a string where a number belongs is a 400, not a coercion); unknown OpenAI
fields are ignored. Response builders return plain dicts in exactly OpenAI's shapes. No behaviour lives here.
"""

from __future__ import annotations

import math
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

if TYPE_CHECKING:
    from scheduler import Plan

NonEmpty = Annotated[str, StringConstraints(min_length=1, max_length=256)]


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
    model_config = ConfigDict(strict=True, extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        _reject_unencodable(data)
        return data


class ContentPart(_Strict):
    """A content part of any type, so an image or audio part reaches ChatService.validate and is refused
    there by name (400 unsupported_content) rather than as a schema mismatch; only "text" parts are served."""

    type: str
    text: str | None = None


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


class ChatCompletionRequest(_Strict):
    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = Field(default=None, max_length=256)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None  # token id (a decimal string) -> bias in [-100, 100]
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    response_format: dict[str, Any] | None = None  # only {"type": "text"} is served
    # declared so that ChatService.validate refuses them by name instead of ignoring them (no tool calling)
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    modalities: list[str] | None = None  # only ["text"] is served
    audio: dict[str, Any] | None = None  # audio output: refused

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class MemoryMessage(_Strict):
    role: str
    content: str
    chat_time: str | None = None


class TimeRange(_Strict):
    start: str | None = None
    end: str | None = None


class SearchFilters(_Strict):
    session_id: str | None = None
    tags: list[str] | None = None
    time_range: TimeRange | None = None


class AddMemoriesRequest(_Strict):
    user_id: NonEmpty
    session_id: str | None = None
    text: str | None = None
    messages: list[MemoryMessage] | None = None
    chat_time: str | None = None
    tags: list[str] | None = None
    metadata: dict[str, Any] | None = None


class SearchMemoriesRequest(_Strict):
    user_id: NonEmpty
    query: str
    top_k: int = Field(default=10, ge=1, le=100)
    filters: SearchFilters | None = None
    include_superseded: bool = False  # also memories a newer one superseded (for questions about the past)


class PrewarmRequest(_Strict):
    user_id: NonEmpty


class UpdateMemoryRequest(_Strict):
    user_id: NonEmpty
    text: str | None = None
    tags: list[str] | None = None
    metadata: dict[str, Any] | None = None


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
