"""Issue 43 item 4: the transformers backend hands a step's items to the event loop in one hop (one
call_soon_threadsafe per model-loop turn, serving/engine/handoff.py), not one per token per stream; the
tokens and results streamed are the same as before."""

from __future__ import annotations

import asyncio

from serving.backends.base import GenerationRequest, SamplingParams, TokenDelta
from tests.serving.backends.test_transformers_backend import run_together, tokens_of


def test_concurrent_streams_get_a_steps_tokens_in_one_event_loop_hop(tiny_backend):
    backend = tiny_backend
    requests = []
    for i, (question, max_new) in enumerate([("Hi", 3), ("Where do I live?", 5), ("Tell me more.", 9)]):
        prompt = backend.layout_prompt([], [], [{"role": "user", "content": question}], None)
        requests.append(
            GenerationRequest(f"h{i}", "u", prompt, None, SamplingParams(max_new, temperature=0.0))
        )
    alone = [asyncio.run(tokens_of(backend, r)) for r in requests]
    hops: list = []
    items: list = []

    async def counted(req):
        loop = asyncio.get_running_loop()
        if not hasattr(loop, "_counted"):
            loop._counted, real = True, loop.call_soon_threadsafe

            def hop(callback, *args):
                if getattr(callback, "__name__", "") in ("put_nowait", "_deliver"):  # the items' hand-off
                    hops.append(callback)
                return real(callback, *args)

            loop.call_soon_threadsafe = hop
        ids, result = [], None
        async for item in backend.stream(req):
            items.append(item)
            if isinstance(item, TokenDelta):
                ids.extend(item.token_ids)
            else:
                result = item
        return ids, result

    together = run_together(backend, [counted(r) for r in requests])
    assert [ids for ids, _ in together] == [ids for ids, _ in alone]
    assert [r.completion_tokens for _, r in together] == [3, 5, 9]
    assert [r.finish_reason for _, r in together] == [r.finish_reason for _, r in alone]
    # admitted in one turn, they step together: at most one hop a step (9 steps), against one per item before
    assert 1 <= len(hops) <= 9 < len(items)


def test_a_delta_is_marked_more_when_another_item_came_with_it(tiny_backend, monkeypatch):
    """Each stream's items, as taken from its inbox in batches (one hand-off, or a reader behind): every
    TokenDelta but a batch's last is marked `more` (its SSE chunk goes out in one write with the next's,
    serving/chat/sse.py), the last of a batch is not, and the items are the batches' in order."""
    from serving.engine import handoff

    batches: dict[int, list[list]] = {}
    real_take = handoff.Inbox.take

    async def take(inbox, timeout_s):
        got = await real_take(inbox, timeout_s)
        if got:
            batches.setdefault(id(inbox), []).append(got)
        return got

    monkeypatch.setattr(handoff.Inbox, "take", take)
    backend = tiny_backend
    requests = []
    for i, (question, max_new) in enumerate([("Hi", 4), ("Where do I live?", 7)]):
        prompt = backend.layout_prompt([], [], [{"role": "user", "content": question}], None)
        requests.append(
            GenerationRequest(f"m{i}", "u", prompt, None, SamplingParams(max_new, temperature=0.0))
        )

    async def items_of(req):
        return [item async for item in backend.stream(req)]

    together = run_together(backend, [items_of(r) for r in requests])
    assert len(batches) == 2
    streamed = sorted(together, key=len)
    for items, taken in zip(streamed, sorted(batches.values(), key=lambda b: sum(map(len, b))), strict=True):
        assert items == [obj for batch in taken for obj in batch]  # `more` is not compared: same items
        marks = [item.more for item in items if isinstance(item, TokenDelta)]
        expected = [i < len(b) - 1 for b in taken for i, obj in enumerate(b) if isinstance(obj, TokenDelta)]
        assert marks == expected
        assert any(
            len(b) > 1 for b in taken
        )  # the last delta comes with the result (or the reader fell behind)
