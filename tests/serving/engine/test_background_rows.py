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
from serving.engine.batcher import Batcher
from serving.engine.pages import PagePool, PoolFull, PoolShape
from serving.engine.sequence import EngineSequence
from tests.conftest import prompts_and_blocks
from tests.serving.backends.test_transformers_backend import arrive_together, tokens_of
from tests.serving.engine.test_pool_pressure import request_steps

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


def engine_steps(pool, model, ids, item, max_new: int, out: list, errors: list, **kw):
    """test_pool_pressure's request, its PoolFull kept in `errors` (as the backend reports a 429)."""
    try:
        yield from request_steps(pool, model, ids, item, max_new, out, **kw)
    except PoolFull as exc:
        errors.append(exc)


def test_a_preempted_chat_row_is_not_left_waiting_behind_a_background_row_that_cannot_run(
    tiny_handle, tokenizer
):
    """A background row B reads a resident item with no page of its own (its prompt is the item's tokens); a
    chat row C fills the rest of the pool and must preempt itself (B has no own page to give). B takes no
    step while C waits, and C cannot come back while B holds the item: the background row goes (PoolFull),
    and C ends with the tokens it gets alone, within a bounded number of steps."""
    model = tiny_handle.model
    _, item = prompts_and_blocks(tiny_handle, tokenizer)[0]
    pt = 16
    b_ids = list(item.token_ids)
    assert len(b_ids) % pt not in (0, 1)  # B's last token and its first replies sit in its copy-on-write page
    c_ids = tokenizer.encode(" ".join(f"word{i}" for i in range(200)))[: 3 * pt]
    shape = PoolShape.of_model(model, pt)
    pages = -(-len(b_ids) // pt) + 1 + 3  # the item's, B's copy-on-write page, C's prompt: none left
    alone_pool = PagePool(shape, 64 * shape.page_bytes)
    alone: list[int] = []
    run_alone = Batcher()
    steps = engine_steps(alone_pool, model, c_ids, None, 8, alone, [])
    run_alone.add(next(steps), steps)
    while len(run_alone):
        run_alone.step()
    pool = PagePool(shape, pages * shape.page_bytes)
    batcher = Batcher()
    outs, errors = ([], []), ([], [])
    for k, (ids, it, bg) in enumerate(((b_ids, item, True), (c_ids, None, False))):
        steps = engine_steps(pool, model, ids, it, 8, outs[k], errors[k], background=bg)
        seq = next(steps)
        assert isinstance(seq, EngineSequence)
        batcher.add(seq, steps)
    assert pool.free_pages == 0
    for _ in range(100):
        if not len(batcher) or batcher.idle():
            break
        batcher.step()
    assert len(batcher) == 0
    assert outs[1] == alone and errors[1] == []  # the chat row: its tokens alone
    assert len(errors[0]) == 1  # the background row was sacrificed


def test_when_every_member_waits_an_older_background_row_fails_before_a_younger_chat_row(
    tiny_handle, tokenizer
):
    """B (background, older) and C (chat) both preempted over their items; the pool's free pages are taken by
    another holder, so C (readmitted first: a chat member) finds none and nothing runs. B, not C, gets
    PoolFull (background rows are sacrificed first); C then comes back and ends with its tokens alone."""
    model = tiny_handle.model
    requests = prompts_and_blocks(tiny_handle, tokenizer)
    (b_ids, b_item), (c_ids, c_item) = requests[0], requests[2]
    assert b_item is not None and c_item is not None
    shape = PoolShape.of_model(model, 16)
    alone: list[int] = []
    run_alone = Batcher()
    steps = engine_steps(PagePool(shape, 256 * shape.page_bytes), model, c_ids, c_item, 6, alone, [])
    run_alone.add(next(steps), steps)
    while len(run_alone):
        run_alone.step()
    pool = PagePool(shape, 256 * shape.page_bytes)
    batcher = Batcher()
    outs, errors, seqs = ([], []), ([], []), []
    for k, (ids, it, bg) in enumerate(((b_ids, b_item, True), (c_ids, c_item, False))):
        steps = engine_steps(pool, model, ids, it, 6, outs[k], errors[k], background=bg)
        seqs.append(next(steps))
        batcher.add(seqs[-1], steps)
    for seq in seqs:  # as _make_room preempts them when a step finds no page
        seq.preempt()
    hog = pool.alloc(pool.free_pages)  # another holder's pages: nothing is free, both items are read
    for _ in range(50):
        if not len(batcher) or batcher.idle():
            break
        batcher.step()
    pool.release(hog)
    assert len(batcher) == 0
    assert len(errors[0]) == 1 and outs[0] == []  # the background row went
    assert errors[1] == [] and outs[1] == alone  # the chat row: its tokens alone
