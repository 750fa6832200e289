"""Who gets pages when the pool is short (review defects of wave 4): requests that wait at admission are
admitted in the order they came (waiting.py), a preempted background row never locks chat requests out,
and a preempted sequence that nothing can give pages back to neither waits forever nor misses its client's
leaving (batcher.py)."""

from __future__ import annotations

import threading
import time

import pytest

from kvmem.kv import Sampling
from serving.engine.batcher import Batcher
from serving.engine.model_loop import ModelLoop
from serving.engine.pages import PagePool, PoolFull, PoolShape
from serving.engine.sequence import AdmissionWait, EngineSequence, admit
from tests.serving.engine.test_pool_pressure import request_steps

PT = 16


def pool_of(model, pages: int) -> PagePool:
    shape = PoolShape.of_model(model, PT)
    return PagePool(shape, pages * shape.page_bytes)


def prompt(first: int, pages: int) -> list[int]:
    return [first + i for i in range(pages * PT)]


def joined(batcher, pool, model, ids, max_new: int, out: list, **kw) -> EngineSequence:
    """A request admitted and added to `batcher` (as the model loop does): its sequence."""
    steps = request_steps(pool, model, ids, None, max_new, out, stop_token_ids=frozenset(), **kw)
    seq = next(steps)
    batcher.add(seq, steps)
    return seq


def try_admit(pool, model, ids, **kw) -> EngineSequence | PoolFull:
    """One admission attempt that does not wait: the sequence, or the PoolFull it got."""
    try:
        return next(admit(pool, model, ids, max_new_tokens=1, wait_s=0.0, sampling=Sampling(), **kw))
    except PoolFull as full:
        return full


def test_requests_that_wait_for_pages_are_admitted_in_the_order_they_came(tiny_handle):
    model = tiny_handle.model
    pool = pool_of(model, 10)
    held = pool.alloc(8)  # what running requests hold: 2 pages free
    big = admit(pool, model, prompt(1000, 5), max_new_tokens=1, wait_s=30.0, sampling=Sampling())
    assert isinstance(next(big), AdmissionWait)  # 5 pages: it waits, first
    assert len(pool.waiting) == 1
    # a later 2-page request finds its pages free, and still waits behind the one that came first
    refused = try_admit(pool, model, prompt(2000, 2))
    assert isinstance(refused, PoolFull)
    assert (
        str(refused)
        == "the KV pool has 2 free pages of 16 tokens; 1 requests that came first wait for pages first"
    )
    assert pool.free_pages == 2  # nothing was taken nor evicted
    pool.release(held[:3])  # 5 free: the first one's turn
    seq = next(big)
    assert isinstance(seq, EngineSequence) and len(pool.waiting) == 0
    small = try_admit(pool, model, prompt(2000, 2))  # nobody waits any more, but there is no room
    assert isinstance(small, PoolFull) and "this request needs 2" in str(small)
    seq.release()
    small = try_admit(pool, model, prompt(2000, 2))
    assert isinstance(small, EngineSequence)
    small.release()
    pool.release(held[3:])
    assert pool.used_pages == 0


def test_a_waiting_request_whose_client_left_or_whose_wait_ended_holds_nobody_back(tiny_handle):
    model = tiny_handle.model
    pool = pool_of(model, 10)
    held = pool.alloc(8)
    cancel = threading.Event()
    gone = admit(
        pool,
        model,
        prompt(1000, 5),
        max_new_tokens=1,
        wait_s=30.0,
        sampling=Sampling(),
        should_stop=cancel.is_set,
    )
    assert isinstance(next(gone), AdmissionWait)
    generation = pool.generation
    cancel.set()
    with pytest.raises(StopIteration):  # its client left: it returns without a sequence, and leaves the queue
        next(gone)
    assert len(pool.waiting) == 0 and pool.generation > generation  # the next waiter looks again
    # a request whose generator was never closed holds nobody back once its wait is over
    lost = admit(pool, model, prompt(1000, 5), max_new_tokens=1, wait_s=0.2, sampling=Sampling())
    assert isinstance(next(lost), AdmissionWait) and len(pool.waiting) == 1
    assert isinstance(try_admit(pool, model, prompt(2000, 2)), PoolFull)
    time.sleep(0.25)
    seq = try_admit(pool, model, prompt(2000, 2))
    assert isinstance(seq, EngineSequence)
    seq.release()
    lost.close()
    assert len(pool.waiting) == 0
    pool.release(held)


def test_a_waiting_background_row_holds_no_chat_request_back_and_waits_behind_them(tiny_handle):
    model = tiny_handle.model
    pool = pool_of(model, 10)
    held = pool.alloc(8)
    formation = admit(
        pool, model, prompt(1000, 5), max_new_tokens=1, wait_s=30.0, sampling=Sampling(), background=True
    )
    assert isinstance(next(formation), AdmissionWait)
    chat = try_admit(pool, model, prompt(2000, 2))  # the background ticket does not count for chat
    assert isinstance(chat, EngineSequence)
    chat.release()
    waiting_chat = admit(pool, model, prompt(3000, 5), max_new_tokens=1, wait_s=30.0, sampling=Sampling())
    assert isinstance(next(waiting_chat), AdmissionWait)
    pool.release(held[:3])  # 5 free: the chat request goes first though the background row came first
    assert isinstance(next(formation), AdmissionWait)
    seq = next(waiting_chat)
    assert isinstance(seq, EngineSequence)
    seq.release()
    row = next(formation)
    assert isinstance(row, EngineSequence) and row.background and row.table.background
    row.release()
    pool.release(held[3:])
    assert pool.used_pages == 0 and len(pool.waiting) == 0


def test_a_preempted_background_row_does_not_lock_chat_requests_out(tiny_handle):
    """A formation row preempted for a chat row's pages waits in pool.preempted; a new chat request is
    admitted meanwhile (the pages it needs are free), a new background one waits behind it."""
    model = tiny_handle.model
    pool = pool_of(model, 40)
    batcher = Batcher(prefill_budget_tokens=64)
    chat_out, form_out = [], []
    chat_seq = joined(batcher, pool, model, prompt(100, 1), 560, chat_out)
    while len(chat_out) < 400:  # 26 pages of the 40
        batcher.step()
    form_seq = joined(batcher, pool, model, prompt(700, 10), 100, form_out, background=True)
    while not form_seq.preempted:  # the chat reply takes the pages back as it grows
        batcher.step()
    assert not chat_seq.finished and pool.free_pages >= 2
    new_chat = try_admit(pool, model, prompt(900, 2)[:20])
    assert isinstance(new_chat, EngineSequence)
    new_chat.release()
    new_row = try_admit(pool, model, prompt(900, 2)[:20], background=True)
    assert isinstance(new_row, PoolFull) and "1 preempted sequences wait for pages first" in str(new_row)
    while len(batcher):
        batcher.step()
    assert len(chat_out) == 560 and len(form_out) == 100  # the formation row ended once the reply did
    assert not pool.preempted and pool.used_pages == 0


def stalled_request(
    pool,
    model,
    wait_s: float,
    cancel: threading.Event | None,
    outcome: list,
    out: list,
    background: bool = False,
):
    """A request alone in the loop whose reply outgrows the pages left to it (the test holds the others):
    it preempts itself and nothing running can give it pages back (`background`: a formation row's)."""

    def steps():
        try:
            yield from request_steps(
                pool,
                model,
                prompt(100, 1)[:20],
                None,
                60,
                out,
                wait_s=wait_s,
                should_stop=None if cancel is None else cancel.is_set,
                stop_token_ids=frozenset(),
                background=background,
            )
            outcome.append("ended")
        except PoolFull as full:
            outcome.append(full)

    return steps()


def test_a_preempted_request_nothing_can_give_pages_back_to_gets_pool_full_after_its_wait(tiny_handle):
    model = tiny_handle.model
    pool = pool_of(model, 6)  # its 80 positions fit in 5 pages: it could run alone (no 400)
    loop, outcome, out = ModelLoop(), [], []
    try:
        outside = pool.alloc(3)  # a hold the loop cannot see (a pinned user's pages, another thread's)
        loop.start(stalled_request(pool, model, 0.5, threading.Event(), outcome, out))
        deadline = time.monotonic() + 30
        while not outcome and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(outcome) == 1 and isinstance(outcome[0], PoolFull), outcome
        assert str(outcome[0]).startswith("preempted, and the KV pool gave no pages back in 0.5 s")
        assert 0 < len(out) < 60
        assert loop.call(lambda: (len(pool.preempted), pool.used_pages)) == (0, 3)
        pool.release(outside)
        # the loop serves the next request as before
        outcome.clear()
        out.clear()
        loop.start(stalled_request(pool, model, 0.5, threading.Event(), outcome, out))
        while not outcome and time.monotonic() < deadline:
            time.sleep(0.05)
        assert outcome == ["ended"] and len(out) == 60
    finally:
        loop.close()


def test_a_preempted_request_waiting_for_pages_ends_when_its_client_leaves(tiny_handle):
    model = tiny_handle.model
    pool = pool_of(model, 6)
    loop, outcome, out, cancel = ModelLoop(), [], [], threading.Event()
    try:
        outside = pool.alloc(3)
        loop.start(stalled_request(pool, model, 600.0, cancel, outcome, out))
        deadline = time.monotonic() + 30
        while not (pool.preempted and loop._batcher.idle()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pool.preempted and loop._batcher.idle()  # stalled: the loop sleeps
        cancel.set()
        loop.wake()  # what the stream does when its client leaves (steps.py)
        while not outcome and time.monotonic() < deadline:
            time.sleep(0.05)
        assert outcome == ["ended"] and 0 < len(out) < 60
        assert loop.call(lambda: (len(pool.preempted), pool.used_pages)) == (0, 3)
        pool.release(outside)
    finally:
        loop.close()


def test_a_member_preempted_while_others_ran_gets_its_whole_wait_once_nothing_runs(tiny_handle):
    """The wait of a stalled batcher counts from when nothing could run, not from the preemption: a member
    preempted long before (another ran meanwhile) is admitted again when the pages come back a turn after
    the stall began (a finished build's read steps hold them a few turns: builds.py)."""
    model = tiny_handle.model
    pool = pool_of(model, 8)
    batcher = Batcher(prefill_budget_tokens=64)
    a_out, c_out = [], []
    a = joined(batcher, pool, model, prompt(100, 1), 100, a_out)
    a.release = lambda: None  # its pages are given back by the test, a turn after it ends
    c = joined(batcher, pool, model, prompt(300, 1), 60, c_out, wait_s=0.5)
    while not c.preempted:
        batcher.step()
    time.sleep(0.6)  # longer than its wait, while the other one runs
    while a in batcher._members:
        batcher.step()
    assert len(a_out) == 100 and c.preempted
    batcher.step()  # the first turn nothing runs: it waits, it does not fail
    assert c in batcher._members and c.preempted
    a.table.close()  # the pages come back
    while len(batcher):
        batcher.step()
    assert len(c_out) == 60 and pool.used_pages == 0


def test_a_build_that_waits_for_pages_holds_no_chat_request_back(tiny_handle):
    """A block build's admission (builds.py) waits behind chat requests, as a background row's does."""
    from concurrent.futures import Future
    from types import SimpleNamespace

    from serving.backends.transformers.builds import EngineBuilds

    model = tiny_handle.model
    pool = pool_of(model, 10)
    held = pool.alloc(8)
    backend = SimpleNamespace(
        pool=pool,
        handle=tiny_handle,
        config=SimpleNamespace(
            kv_wait_s=10.0, build_chunk_tokens=16, prefill_chunk_tokens=512, build_attention_budget=32768
        ),
    )
    build = EngineBuilds._prefill_steps(backend, prompt(1000, 5), None, 0, Future(), None, threading.Event())
    assert isinstance(next(build), AdmissionWait) and len(pool.waiting) == 1
    chat = try_admit(pool, model, prompt(10, 1)[:10])
    assert isinstance(chat, EngineSequence), chat
    chat.release()
    build.close()
    pool.release(held)
    assert len(pool.waiting) == 0 and pool.used_pages == 0


def test_a_session_turn_that_could_never_be_admitted_beside_the_page_it_copies_is_400(tiny_handle):
    """A turn reading a history that ends mid-page holds that page at its admission beside its prompt's own
    (it copies from it): counted, a turn that could never be admitted is refused at once, not left to wait
    (and hold every later request back) until its 429."""
    from serving.engine.errors import PoolTooSmall
    from serving.engine.table import PageTable

    model = tiny_handle.model
    pool = pool_of(model, 6)
    history = PageTable.admit(pool, 40)
    history.extend(40, pool.k.device)
    history.keep(40)  # the 40 tokens the turn reads (sessions.trim): 3 pages, the last one partly
    turn = admit(
        pool,
        model,
        list(range(6 * PT - 1)),
        source=(history, 40),
        max_new_tokens=1,
        wait_s=30.0,
        sampling=Sampling(),
    )
    with pytest.raises(PoolTooSmall):
        next(turn)
    assert len(pool.waiting) == 0
    history.close()
    assert pool.used_pages == 0
