"""The batcher's order under pressure (wave 4, third review): a new chat member runs while the batcher is
stalled on a preempted background row; a preempted background row never takes the pages a waiting chat request
waits for; a preempted build never holds a preempted chat member (and so every new chat request) back; a
session's turn that waits never holds the history pages a preempted member needs."""

from __future__ import annotations

import time

from kvmem.kv import Sampling
from serving.engine.batcher import Batcher
from serving.engine.model_loop import ModelLoop
from serving.engine.pages import PagePool, PoolFull, PoolShape
from serving.engine.sequence import AdmissionWait, EngineSequence, admit
from serving.engine.sessions import SessionCache
from tests.conftest import prompts_and_blocks
from tests.serving.engine.test_pool_fairness import joined, pool_of, prompt, stalled_request, try_admit
from tests.serving.engine.test_pool_pressure import request_steps
from tests.serving.engine.test_session_pages import finish


def test_a_new_chat_member_runs_while_a_background_row_is_stalled(tiny_handle):
    """The formation row waits (preempted, its pages held outside the loop) for up to 60 s; a chat request
    admitted meanwhile is stepped at once, not after that wait (Batcher.add ends the stall)."""
    model = tiny_handle.model
    pool = pool_of(model, 6)
    loop = ModelLoop()
    outcome, form_out, chat_out, chat_done = [], [], [], []
    try:
        pool.alloc(3)  # pages held outside the loop (a pinned user's)

        loop.start(stalled_request(pool, model, 60.0, None, outcome, form_out, background=True))
        deadline = time.monotonic() + 30
        while not (pool.preempted and loop._batcher.idle()) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert pool.preempted and loop._batcher.idle(), "the formation row should be stalled"

        def chat():
            yield from request_steps(
                pool, model, prompt(500, 1)[:10], None, 3, chat_out, stop_token_ids=frozenset()
            )
            chat_done.append(time.monotonic())

        began = time.monotonic()
        loop.start(chat())
        deadline = began + 120
        while not chat_done and time.monotonic() < deadline:
            time.sleep(0.02)
        # a liveness bound, not a speed figure: 3 tokens of the tiny model, against the row's 60 s wait
        assert chat_done and chat_done[0] - began < 30, "the chat reply waited for the stalled row's wait"
        assert len(chat_out) == 3 and outcome == []
    finally:
        loop.close()


def test_a_preempted_background_row_waits_behind_a_waiting_chat_request(tiny_handle):
    model = tiny_handle.model
    pool = pool_of(model, 10)
    batcher = Batcher(prefill_budget_tokens=64)
    form = joined(batcher, pool, model, prompt(700, 3), 20, [], background=True)
    outside = pool.alloc(pool.free_pages)  # the rest: running requests' (released below)
    form.preempt()  # as _make_room does for an older chat row's page
    assert pool.free_pages == 3
    chat = admit(pool, model, prompt(2000, 5), max_new_tokens=1, wait_s=30.0, sampling=Sampling())
    assert isinstance(next(chat), AdmissionWait) and len(pool.waiting) == 1  # a chat request waits for 5
    batcher.step()  # the model loop's next turn: the formation row is not admitted again ahead of it
    assert form.preempted and pool.free_pages == 3
    pool.release(outside[:2])
    got = next(chat)
    try:
        assert isinstance(got, EngineSequence)
        batcher.step()  # now the formation row may try (no chat ticket waits); it finds no room
        assert form.preempted
    finally:
        chat.close()
        if isinstance(got, EngineSequence):
            got.release()
        batcher.close()
        pool.release(outside[2:])


def test_a_preempted_build_does_not_hold_a_preempted_chat_request_back(tiny_handle):
    model = tiny_handle.model
    pool = pool_of(model, 12)
    batcher = Batcher(prefill_budget_tokens=64)
    build = joined(batcher, pool, model, prompt(700, 6), 1, [], yield_to_chat=True)
    chat = joined(batcher, pool, model, prompt(100, 2), 8, [])
    outside = pool.alloc(pool.free_pages)  # an older request's pages (released below)
    chat.preempt()  # as _make_room does for that older request's pages, newest first
    build.preempt()
    held = pool.alloc(pool.free_pages)  # taken again meanwhile
    pool.release(outside)  # room for the chat request (2+ pages), not for the build (6)
    batcher.step()
    try:
        assert not chat.preempted and build.preempted
        new = try_admit(pool, model, prompt(900, 1)[:8])
        assert isinstance(new, EngineSequence), f"a new chat request is held back: {new}"
        new.release()
    finally:
        batcher.close()
        pool.release(held)


def test_a_waiting_session_turn_does_not_lock_out_the_preempted_member_it_waits_for(tiny_handle):
    """A live session's next turn that has to wait gives its history's pages back (sequence.py `admit`):
    held, they were the very pages the preempted member it waits behind needed (neither could go on)."""
    model = tiny_handle.model
    pool = pool_of(model, 12)
    sessions = SessionCache(1 << 30)
    pool.reclaimers.append(sessions)
    history = prompt(100, 4)
    lease = sessions.take("alice", "s1", None, ())
    seq = next(admit(pool, model, history, max_new_tokens=2, sampling=Sampling(max_new_tokens=2)))
    finish(model, pool, seq)
    table = seq.keep_table()
    assert sessions.put(lease, (*history, *seq.stats.token_ids)[: table.length], table)
    seq.release()
    kept = len(table.pages)
    batcher = Batcher(prefill_budget_tokens=64)
    out = []
    m = joined(batcher, pool, model, prompt(3000, 3), 4, out, wait_s=0.5)
    outside = pool.alloc(pool.free_pages)  # an older request's pages
    m.preempt()
    outside += pool.alloc(pool.free_pages - 1)  # 1 free (2 once the turn trims its history): m needs 3
    # the session's next turn: takes its entry, trims it to what it reads, waits (m is preempted)
    lease = sessions.take("alice", "s1", None, ())
    ids = [*history, *prompt(5000, 1)]
    n = sessions.reuse(lease, ids, 0)
    sessions.trim(lease, n)
    turn = admit(
        pool,
        model,
        ids,
        source=(lease.entry.cache, n),
        max_new_tokens=2,
        wait_s=5.0,
        sampling=Sampling(max_new_tokens=2),
    )
    assert isinstance(next(turn), AdmissionWait)
    try:
        end = time.monotonic() + 1.0
        while m in batcher._members and m.preempted and time.monotonic() < end:
            batcher.step()
            time.sleep(0.05)
        assert not m.preempted or out, (
            f"the preempted member could not get pages back: the waiting turn's lease holds {kept} idle "
            f"history pages; member {'failed' if m not in batcher._members else 'still preempted'}"
        )
        while m in batcher._members:
            batcher.step()
        pool.release(outside)
        outside = []
        got = next(turn)  # room now: admitted without its history (usage then reports none of it cached)
        assert isinstance(got, EngineSequence) and got.table.reused == 0 and not got.table.from_session
        got.release()
    finally:
        turn.close()
        sessions.release(lease)
        batcher.close()
        pool.release(outside)


def test_a_preempted_background_row_holding_its_block_is_let_back_in_to_free_it(tiny_handle, tokenizer):
    """The preempted formation row reads a block; a chat request waits at admission for pages only that
    block's eviction frees. The row holds pages, so it is not kept back for the chat request (it would hold
    the block until the chat request's 429): it is let back in, finishes, and the chat request runs."""
    model = tiny_handle.model
    ids, item = prompts_and_blocks(tiny_handle, tokenizer)[0]
    shape = PoolShape.of_model(model, 16)
    item_pages = -(-item.num_tokens // 16)
    pool = PagePool(shape, (item_pages + 12) * shape.page_bytes)
    loop = ModelLoop(prefill_budget_tokens=64)
    form_out, chat_out, chat_res = [], [], []
    try:

        def formation():
            yield from request_steps(
                pool, model, ids, item, 3, form_out, stop_token_ids=frozenset(), background=True, wait_s=30.0
            )

        def chat():
            try:
                yield from request_steps(
                    pool,
                    model,
                    [5000 + i for i in range(3 * 16)],
                    None,
                    1,
                    chat_out,
                    stop_token_ids=frozenset(),
                    wait_s=2.0,
                )
                chat_res.append("ok")
            except PoolFull as e:
                chat_res.append(e)

        # admit the row on this thread, then hand it over preempted (as _make_room would for an older row)
        gen = formation()
        seq = next(gen)
        assert isinstance(seq, EngineSequence)
        outside = pool.alloc(pool.free_pages)
        seq.preempt()
        pool.release(outside[:1])  # 2 free: the row's own page(s) fit, the chat's 3 pages do not
        loop.start(chat())
        end = time.monotonic() + 10
        while not len(pool.waiting) and time.monotonic() < end:
            time.sleep(0.01)
        assert len(pool.waiting) == 1  # the chat request waits at admission
        loop.call(lambda: loop._batcher.add(seq, gen))
        deadline = time.monotonic() + 20
        while not chat_res and time.monotonic() < deadline:
            time.sleep(0.05)
        assert chat_res == ["ok"], f"chat: {chat_res}; row tokens {form_out}, row preempted {seq.preempted}"
    finally:
        loop.close()
