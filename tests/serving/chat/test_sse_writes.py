"""Issue 43 item 4: one stream's SSE writes are coalesced. Chunks whose items the backend handed over at once
(a TokenDelta marked `more`) go out in one write, each still its own `data:` line, in order; the role chunk
goes out with the first item's, the last content chunk with the finish chunk, the usage chunk and [DONE]. The
byte stream is exactly the one written a chunk at a time before. The transformers backend marks `more` on
every item of one hand-off but the last."""

from __future__ import annotations

import asyncio
import json

from serving.backends.base import GenerationResult, TokenDelta, TokenLogprob
from serving.chat import sse
from serving.http.protocol import logprobs_dict, usage_dict

RESULT = GenerationResult(
    finish_reason="length", prompt_tokens=11, cached_tokens=4, completion_tokens=5, ttft_s=0.1
)


def writes(items, include_usage=True) -> tuple[list[str], callable]:
    event = sse.chunk_encoder("chatcmpl-1", 7, "default", include_usage)

    async def rest():
        for item in items[1:]:
            yield item

    async def collect():
        out = []
        gen = sse.events("chatcmpl-1", event, include_usage, lambda r: {"m": 1}, items[0], rest())
        async for w in gen:
            out.append(w)
        return out

    return asyncio.run(collect()), event


def test_items_handed_over_together_go_out_in_one_write_each_its_own_chunk():
    items = [
        TokenDelta("Hel", (1,), more=True),
        TokenDelta("lo", (2,)),
        TokenDelta("", (3,)),  # a character still incomplete: no chunk, no write
        TokenDelta(" wö", (4,), more=True),
        TokenDelta("rld", (5,), more=True),
        RESULT,
    ]
    out, event = writes(items)
    role = event({"role": "assistant", "content": ""})
    c = [event({"content": t}) for t in ("Hel", "lo", " wö", "rld")]
    finish = event({}, finish_reason="length", memory={"m": 1})
    usage = event(None, usage=usage_dict(11, 5, 4))
    assert out == [role + c[0] + c[1], c[2] + c[3] + finish + usage + "data: [DONE]\n\n"]
    assert [
        json.loads(line[6:])["choices"][0]["delta"].get("content") for line in out[1].split("\n\n")[:2]
    ] == [
        " wö",
        "rld",
    ]


def test_items_handed_over_one_by_one_go_out_one_write_each():
    lp = (TokenLogprob(token="x", logprob=-0.5, bytes=(120,)),)
    items = [TokenDelta("a", (1,)), TokenDelta("", (2,), logprobs=lp), TokenDelta("b", (3,)), RESULT]
    out, event = writes(items, include_usage=False)

    assert out == [
        event({"role": "assistant", "content": ""}) + event({"content": "a"}),
        event({"content": ""}, logprobs=logprobs_dict(lp)),  # its logprob, with no text yet
        event({"content": "b"}),
        event({}, finish_reason="length", memory={"m": 1}) + "data: [DONE]\n\n",
    ]


def test_a_stream_ending_without_a_result_still_ends_with_done():
    out, event = writes([TokenDelta("a", (1,), more=True)])
    assert out == [event({"role": "assistant", "content": ""}) + event({"content": "a"}) + "data: [DONE]\n\n"]


def test_more_is_not_part_of_what_a_delta_says():
    assert TokenDelta("a", (1,), more=True) == TokenDelta("a", (1,))
