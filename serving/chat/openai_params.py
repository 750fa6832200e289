"""Which of OpenAI's chat parameters kvmem serves, which it refuses by name, and the sampling the served ones ask.

Served: presence/frequency penalties, logit_bias, logprobs/top_logprobs and `response_format` of type
"json_object" or "json_schema" (where the backend lists them in `Backend.sampling_features`), `response_format`
{"type": "text"} (a no-op). A malformed response format is a 400 `invalid_value` naming its field. Refused with
400 `unsupported_parameter` naming the field: tools and functions, other response format types, audio output
(`modalities` beyond text, `audio`), and a served feature the backend cannot apply; image, audio and file
content parts get 400 `unsupported_content` naming the part type. Knows nothing of HTTP or the model: given
the request and what the backend says of itself.
"""

from __future__ import annotations

import json
import re
from typing import Any

from serving.backends.base import ResponseFormat, SamplingParams
from serving.http.protocol import ApiError, ChatCompletionRequest, bad_request

# tool calling is not served; an empty list or "none" asks for nothing and is accepted (some clients send it)
TOOL_FIELDS = ("tools", "tool_choice", "functions", "function_call")
MAX_LOGIT_BIAS = 300  # entries, as OpenAI
LOGIT_BIAS_RANGE = (-100.0, 100.0)
SCHEMA_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for json_schema.name
MAX_TOKEN_ID_DIGITS = 18  # a longer logit_bias key is no token id of any vocabulary


def unsupported(message: str, param: str) -> ApiError:
    return bad_request(message, param=param, code="unsupported_parameter")


def check_params(
    body: ChatCompletionRequest,
    *,
    backend_name: str,
    sampling_features: frozenset[str],
    vocab_size: int | None,
) -> None:
    """Raise ApiError (400) for the first parameter or content part the request asks for that is not served."""
    for name in TOOL_FIELDS:
        value = getattr(body, name)
        if value is not None and value != [] and value != "none":
            raise unsupported(f"`{name}` is not supported: this server does not call tools", name)
    if body.modalities is not None and set(body.modalities) - {"text"}:
        kinds = sorted(set(body.modalities) - {"text"})
        raise unsupported(f"modalities {kinds} are not supported; this server answers in text", "modalities")
    if body.audio is not None:
        raise unsupported("`audio` is not supported; this server answers in text", "audio")
    for i, message in enumerate(body.messages):
        if isinstance(message.content, str):
            continue
        for j, part in enumerate(message.content):
            where = f"messages[{i}].content[{j}]"
            if part.type != "text":
                raise bad_request(
                    f"{where}: content parts of type {part.type!r} are not supported; only 'text' parts are",
                    param=where,
                    code="unsupported_content",
                )
            if part.text is None:
                raise bad_request(
                    f"{where}: a text part needs `text`", param=f"{where}.text", code="invalid_value"
                )
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", param="top_logprobs", code="invalid_value")
    extras = sampling_extras(body, vocab_size)
    for feature in sorted(SamplingParams(max_new_tokens=1, **extras).features - sampling_features):
        raise unsupported(f"`{feature}` is not supported by the {backend_name} backend", feature)


def logit_bias(body: ChatCompletionRequest, vocab_size: int | None) -> tuple[tuple[int, float], ...]:
    """The request's logit_bias as (token id, bias), sorted by id. Raises ApiError (400, param logit_bias) for a
    key that is not a token id of the vocabulary, a bias outside [-100, 100] or more than 300 entries."""
    if not body.logit_bias:
        return ()
    if len(body.logit_bias) > MAX_LOGIT_BIAS:
        raise bad_request(f"logit_bias may have at most {MAX_LOGIT_BIAS} entries", param="logit_bias")
    out: dict[int, float] = {}
    low, high = LOGIT_BIAS_RANGE
    for key, bias in body.logit_bias.items():
        if not (key.isascii() and key.isdigit()):
            raise bad_request(
                f"logit_bias keys must be token ids (decimal strings), got {key!r}",
                param="logit_bias",
                code="invalid_value",
            )
        token = int(key) if len(key) <= MAX_TOKEN_ID_DIGITS else None  # int() refuses over 4,300 digits
        if token is None or (vocab_size is not None and token >= vocab_size):
            shown = key if token is not None else key[:MAX_TOKEN_ID_DIGITS] + "..."
            ids = "" if vocab_size is None else f" (ids 0..{vocab_size - 1})"
            raise bad_request(
                f"logit_bias token id {shown} is not in the vocabulary{ids}",
                param="logit_bias",
                code="invalid_value",
            )
        if not low <= bias <= high:
            raise bad_request(
                f"logit_bias[{key!r}] is {bias}; biases must be in [{low:g}, {high:g}]",
                param="logit_bias",
                code="invalid_value",
            )
        out[token] = float(bias)
    return tuple(sorted(out.items()))


def response_format(body: ChatCompletionRequest) -> ResponseFormat | None:
    """The request's response format; None for none or {"type": "text"}. Raises ApiError 400: an unknown type
    (unsupported_parameter), a json_schema without a valid `name` or an object `schema` (invalid_value)."""
    spec = body.response_format
    kind = None if spec is None else spec.get("type")
    if spec is None or kind == "text":
        return None
    if kind == "json_object":
        return ResponseFormat("json_object")
    if kind != "json_schema":
        raise unsupported(
            f"response_format of type {kind!r} is not supported; 'text', 'json_object' and 'json_schema' are",
            "response_format",
        )
    inner = spec.get("json_schema")
    if not isinstance(inner, dict):
        raise bad_request(
            "response_format of type 'json_schema' needs `json_schema`: an object with `name` and `schema`",
            param="response_format.json_schema",
            code="invalid_value",
        )
    name = inner.get("name")
    if not isinstance(name, str) or not SCHEMA_NAME.fullmatch(name):
        raise bad_request(
            "response_format.json_schema.name must be 1 to 64 letters, digits, underscores or dashes, "
            f"got {name!r}",
            param="response_format.json_schema.name",
            code="invalid_value",
        )
    schema = inner.get("schema")
    if not isinstance(schema, dict):
        raise bad_request(
            f"response_format.json_schema.schema of {name!r} must be a JSON Schema object, "
            f"got {type(schema).__name__}",
            param="response_format.json_schema.schema",
            code="invalid_value",
        )
    # the properties' order is kept: the reply writes them in it
    return ResponseFormat("json_schema", json.dumps(schema, separators=(",", ":")), name)


def sampling_extras(body: ChatCompletionRequest, vocab_size: int | None) -> dict[str, Any]:
    """The SamplingParams fields beyond temperature, top_p, stop and seed that the request sets."""
    return {
        "response_format": response_format(body),
        "presence_penalty": body.presence_penalty or 0.0,
        "frequency_penalty": body.frequency_penalty or 0.0,
        "logit_bias": logit_bias(body, vocab_size),
        "top_logprobs": (body.top_logprobs or 0) if body.logprobs else None,
    }
