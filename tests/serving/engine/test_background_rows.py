"""Background rows (memory formation on the served model, GenerationRequest.background) within their budget
(serving/engine/batcher.py), counted in engine steps on the tiny llama: a chat row is in every step from its
admission to its end, a chat prompt's chunk is never pushed to a later step by a formation row's, a step
holds at most one formation row, whose prefill chunk is at most 16 tokens while chat rows decode; and every
request, chat or formation, gets the tokens it gets alone."""

from __future__ import annotations

import asyncio

import pytest

from serving.backends.base import GenerationRequest, SamplingParams
from serving.backends.transformers.steps import BACKGROUND_CHUNK_TOKENS
from serving.engine import batcher as batcher_module
from tests.serving.backends.test_transformers_backend import arrive_together, tokens_of

CHAT = [("Hi", 12), ("What is my dog called and what does he like to eat?", 20), ("Tell me a story.", 7)]
FORMATION = "Chat log, oldest first: " + " ".join(
    f"line {i} says the user likes item {i}." for i in range(40)
)


def request(backend, name, text, max_new, background=False) -> GenerationRequest:
    prompt = backend.layout_prompt([], [], [{"role": "user", "content": text}])
    sampling = SamplingParams(max_new_tokens=max_new, temperature=0.0)
    return GenerationRequest(name, "u", prompt, None, sampling, background=background)


@pytest.fixture
def steps(tiny_backend, monkeypatch):
    """Every engine step as [(request name, "p" chunk tokens | "d")], and the chat members that existed
    (admitted, unfinished) before it."""
    backend = tiny_backend
    record: list[tuple[list, set]] = []
    real = batcher_module.runner.step
    batcher = backend._loop._batcher

    def name_of(seq):  # by its prompt (an id() of a finished sequence may be reused by a new one)
        return next(n for n, ids in backend._test_prompts.items() if tuple(seq.prompt_ids) == ids)

    def recording(model, pool, prefills, decodes):
        chat = {name_of(s) for s in batcher._members if not s.background and not s.finished}
        rows = [(name_of(s), s.next_chunk_tokens()) for s in prefills] + [(name_of(s), "d") for s in decodes]
        record.append((rows, chat))
        return real(model, pool, prefills, decodes)

    monkeypatch.setattr(batcher_module.runner, "step", recording)
    backend._test_prompts = {}
    yield record
    del backend._test_prompts


def test_a_formation_row_never_delays_a_chat_row_and_stays_within_its_budget(tiny_backend, steps):
    backend = tiny_backend
    chats = [request(backend, f"chat{i}", text, n) for i, (text, n) in enumerate(CHAT)]
    formations = [request(backend, f"form{i}", FORMATION + f" ({i})", 24, background=True) for i in range(2)]
    everything = [*formations, *chats]  # the formation rows arrive first
    backend._test_prompts.update({r.request_id: tuple(r.prompt.ids) for r in everything})
    alone = [asyncio.run(tokens_of(backend, r))[0] for r in everything]
    steps.clear()
    together = arrive_together(backend, everything)
    assert [ids for ids, _ in together] == alone  # every request's tokens as alone

    chat_names = {r.request_id for r in chats}
    for rows, chat in steps:
        names = [n for n, _ in rows]
        assert chat <= set(names)  # every live chat row is in the step
        formation_rows = [(n, c) for n, c in rows if n not in chat_names]
        if chat:
            assert len(formation_rows) <= 1
            decoding = any(c == "d" for n, c in rows if n in chat_names)
            assert all(c == "d" or not decoding or c <= BACKGROUND_CHUNK_TOKENS for _, c in formation_rows)
    # each chat prompt went in whole in the first step (after the shared head), its first token with it
    first = steps[0][0]
    assert {n for n, c in first if n in chat_names and c != "d"} == chat_names
    # the formation rows did run: each prefilled and decoded its 24 tokens
    for r in formations:
        assert sum(1 for rows, _ in steps for n, c in rows if n == r.request_id and c == "d") == 23
