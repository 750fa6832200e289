"""A streamed chat answer as server-sent events: one OpenAI `chat.completion.chunk` per `data:` line, in order,
several lines to one write when the backend handed their items over at once.

Each yielded string is one write of the response body (Starlette's StreamingResponse sends one body message
per string). A backend marks a TokenDelta `more` when another item of the same stream was handed over with it
(the transformers backend: items of one model-loop turn, serving/engine/handoff.py); the lines of such a run
go out in one write, each still its own chunk. The role chunk goes out with the first item's; the last
content chunk, the finish chunk, the usage chunk and `[DONE]` go out together when they came together.
Knows nothing of the backend or the chat path: it is handed the items and how to encode a chunk.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from serving.backends.base import GenerationResult, StreamItem, TokenDelta
from serving.http.protocol import ApiError, chunk_dict, logprobs_dict, usage_dict

logger = logging.getLogger(__name__)

DONE = "data: [DONE]\n\n"


def chunk_encoder(request_id: str, created: int, model: str, include_usage: bool) -> Callable[..., str]:
    """`event(delta, **kw)`: one chunk's SSE line."""

    def event(delta: dict | None, **kw: Any) -> str:
        chunk = chunk_dict(
            completion_id=request_id,
            created=created,
            model=model,
            delta=delta,
            with_usage_field=include_usage,
            **kw,
        )
        return f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"

    return event


_MARK = "\x00kvmem-content\x00"  # a content no chunk's other fields contain (checked), in JSON
_MARK_JSON = json.dumps(_MARK, ensure_ascii=False)


def content_event(event: Callable[[dict], str]) -> Callable[[str], str]:
    """`text -> event({"content": text})`, made once per stream: the chunk's JSON around its content is the
    same for every token, so only the content is encoded per token (the bytes are the same as event's: the same
    encoder writes the same string in place). Falls back to `event` when the mark is not found once."""
    head, mark, tail = event({"content": _MARK}).partition(_MARK_JSON)
    if not mark or _MARK_JSON in tail:
        return lambda text: event({"content": text})
    dumps = json.dumps
    return lambda text: f"{head}{dumps(text, ensure_ascii=False)}{tail}"


async def events(
    request_id: str,
    event: Callable[..., str],
    include_usage: bool,
    memory: Callable[[GenerationResult], dict | None],
    first: StreamItem,
    items: AsyncIterator[StreamItem],
) -> AsyncIterator[str]:
    """The SSE writes of a stream whose first item is `first` and the rest `items` (closed at the end);
    `memory(result)`: the finish chunk's memory field. An ApiError or a failure after the stream started
    ends it with an error line (after the lines already made)."""
    content = content_event(event)
    pending = [event({"role": "assistant", "content": ""})]

    async def chained() -> AsyncIterator[StreamItem]:
        yield first
        async for item in items:
            yield item

    try:
        async for item in chained():
            if isinstance(item, TokenDelta):
                if item.logprobs:  # a token whose text is not complete yet still brings its logprob
                    pending.append(event({"content": item.text}, logprobs=logprobs_dict(item.logprobs)))
                elif item.text:
                    pending.append(content(item.text))
                if item.more or not pending:
                    continue
                yield "".join(pending)
                pending = []
                continue
            # the result: the stream's last item (its finish chunk goes out with [DONE])
            pending.append(event({}, finish_reason=item.finish_reason, memory=memory(item)))
            if include_usage:
                usage = usage_dict(item.prompt_tokens, item.completion_tokens, item.cached_tokens)
                pending.append(event(None, usage=usage))
        pending.append(DONE)  # also when the stream ended without a result (the client left)
        yield "".join(pending)
    except ApiError as e:
        yield "".join(pending) + f"data: {json.dumps(e.to_dict())}\n\n"
    except Exception:
        logger.exception("stream %s failed after it started", request_id)
        error = ApiError(500, "the backend failed while streaming", type="server_error", code="backend_error")
        yield "".join(pending) + f"data: {json.dumps(error.to_dict())}\n\n"
    finally:
        await items.aclose()  # type: ignore[attr-defined]
