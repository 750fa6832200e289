"""A live session's next turn under a full pool, through the transformers backend (review defect of wave 4):
a turn whose prompt leaves its session's history early reads only the first pages of the history's table;
the rest go back before it waits for pages (sessions.py `trim`) and the table itself once its own references
what it reuses (`started`). Held for the whole turn, those pages were ones the 400 check does not count: a
long reply preempted itself, could never be admitted again, never ended, and every other request got 429."""

from __future__ import annotations

import asyncio

from serving.backends.base import GenerationRequest, SamplingParams
from tests.serving.backends.test_transformers_backend import tokens_of, wait_released
from tests.serving.kvstack import load_backend


def test_a_session_turn_that_leaves_its_history_early_streams_a_reply_that_needs_the_historys_pages(
    tmp_path, tiny_model_dir
):
    backend = load_backend(tiny_model_dir, tmp_path, kv_pool_mb=1, kv_wait_s=2.0)  # 128 pages of 16 tokens
    try:
        pool, no_eos = backend.pool, tuple((t, -100.0) for t in backend._eos)

        def request(rid: str, text: str, max_new: int) -> GenerationRequest:
            prompt = backend.layout_prompt([], [], [{"role": "user", "content": text}])
            sampling = SamplingParams(max_new_tokens=max_new, temperature=0.0, logit_bias=no_eos)
            return GenerationRequest(rid, "alice", prompt, None, sampling, session_id="s1")

        opening = "Let me tell you about my week, it was long. "
        first = request("t1", opening + " ".join(f"word{i}" for i in range(400)), 2)
        asyncio.run(tokens_of(backend, first))
        wait_released(backend)
        kept = len(backend.sessions.peek("alice", "s1").cache.pages)
        head = pool.pages_for(backend.head_item.num_tokens)
        assert kept > 40
        # the next turn edits the history after its opening: it reuses a few of the kept tokens, and its reply
        # fits the pool alone (no 400) but not beside the whole history
        second = request("t2", opening + "Actually, never mind.", 1)
        room = (pool.num_pages - head) * pool.page_tokens - len(second.prompt.ids)
        max_new = room - 4 * pool.page_tokens
        assert pool.pages_for(len(second.prompt.ids) + max_new) + kept > pool.num_pages
        second = request("t2", opening + "Actually, never mind.", max_new)

        async def bounded():
            return await asyncio.wait_for(tokens_of(backend, second), timeout=300)

        ids, result = asyncio.run(bounded())
        assert len(ids) == max_new and result.finish_reason == "length"
        assert len(backend.head_item.token_ids) < result.cached_tokens < 200  # it started from the history
        wait_released(backend)
        assert backend._loop.call(lambda: len(pool.preempted)) == 0
        other = GenerationRequest(
            "o",
            "bob",
            backend.layout_prompt([], [], [{"role": "user", "content": "Hi"}]),
            None,
            SamplingParams(max_new_tokens=2, temperature=0.0),
        )
        assert len(asyncio.run(tokens_of(backend, other))[0]) == 2
    finally:
        asyncio.run(backend.aclose())
