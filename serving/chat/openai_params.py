"""Which of OpenAI's chat parameters kvmem serves, which it refuses by name, and the sampling the served ones ask.

Served: presence/frequency penalties, logit_bias, logprobs/top_logprobs (where the backend lists them in
`Backend.sampling_features`), `response_format` {"type": "text"} (a no-op). Refused with 400
`unsupported_parameter` naming the field: tools and functions, other response formats, audio output
(`modalities` beyond text, `audio`), and a served feature the backend cannot apply; image, audio and file
content parts get 400 `unsupported_content` naming the part type. Knows nothing of HTTP or the model: given
the request and what the backend says of itself.
"""

from __future__ import annotations

from typing import Any

from serving.backends.base import SamplingParams
from serving.http.protocol import ApiError, ChatCompletionRequest, bad_request

# tool calling is not served; an empty list or "none" asks for nothing and is accepted (some clients send it)
TOOL_FIELDS = ("tools", "tool_choice", "functions", "function_call")
MAX_LOGIT_BIAS = 300  # entries, as OpenAI
LOGIT_BIAS_RANGE = (-100.0, 100.0)


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
    if body.response_format is not None and body.response_format.get("type") != "text":
        kind = body.response_format.get("type")
        raise unsupported(
            f"response_format of type {kind!r} is not supported; only {{'type': 'text'}} is",
            "response_format",
        )
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
        token = int(key)
        if vocab_size is not None and token >= vocab_size:
            raise bad_request(
                f"logit_bias token id {token} is not in the vocabulary (ids 0..{vocab_size - 1})",
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


def sampling_extras(body: ChatCompletionRequest, vocab_size: int | None) -> dict[str, Any]:
    """The SamplingParams fields beyond temperature, top_p, stop and seed that the request sets."""
    return {
        "presence_penalty": body.presence_penalty or 0.0,
        "frequency_penalty": body.frequency_penalty or 0.0,
        "logit_bias": logit_bias(body, vocab_size),
        "top_logprobs": (body.top_logprobs or 0) if body.logprobs else None,
    }
