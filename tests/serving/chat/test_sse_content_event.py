"""Issue 43 item 4: a streamed content chunk's SSE event is made from a per-stream template (only the content is
encoded per token), with the same bytes as the chunk's full JSON encoding that was made for every token."""

from __future__ import annotations

import json

from serving.chat.sse import content_event as _content_event
from serving.http.protocol import chunk_dict

TEXTS = [
    "Hello",
    " world",
    "",
    'quote " and backslash \\ and slash /',
    "line\nbreak\r\ttab",
    "\x00\x1f control",
    "é ü 日本語 😀",
    "\ufffd",
    "\u2028\u2029",
    "\x00kvmem-content\x00",  # the template's own mark as content
]


def full_event(model: str, with_usage_field: bool):
    def event(delta, **kw):
        chunk = chunk_dict(
            completion_id="chatcmpl-1",
            created=7,
            model=model,
            delta=delta,
            with_usage_field=with_usage_field,
            **kw,
        )
        return f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"

    return event


def test_a_content_event_has_the_bytes_of_the_full_chunk_encoding():
    for model in ("kvmem-default", 'mödel "quoted"'):
        for with_usage_field in (False, True):
            event = full_event(model, with_usage_field)
            content = _content_event(event)
            for text in TEXTS:
                assert content(text) == event({"content": text})


def test_a_model_name_holding_the_mark_falls_back_to_the_full_encoding():
    event = full_event("x\x00kvmem-content\x00y", False)
    content = _content_event(event)
    for text in TEXTS:
        assert content(text) == event({"content": text})
