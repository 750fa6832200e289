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
