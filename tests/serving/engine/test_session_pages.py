"""Live sessions as pages (serving/engine/table.py, serving/engine/sessions.py): a turn's table stays with its session
when the turn ends, and the next turn references its pages instead of copying the history in and out. The
next turn's greedy tokens equal a full prefill's; pages in use are exactly the resident items' and the live
sessions' (and the running requests'); a dropped, replaced or forgotten entry gives its pages back; a pool
short of pages drops live sessions, least recently used first, before a request waits."""

from __future__ import annotations

from kvmem.kv import Sampling, generate
from kvmem.kv.inject import usable_prefix_tokens
from serving.engine.pages import PagePool, PoolShape
from serving.engine.sessions import SessionCache
from serving.engine.table import PageTable
from tests.conftest import prompts_and_blocks
from tests.serving.engine.test_engine import admitted, make_pool, run_engine

GREEDY = Sampling(max_new_tokens=6)


def finish(model, pool, seq) -> None:
    """Run `seq` to its end through the engine's step."""
    from serving.engine import runner

    while not seq.finished:
        prefills, decodes = ([seq], []) if seq.prefilling else ([], [seq])
        assert all(isinstance(t, int | None) for t in runner.step(model, pool, prefills, decodes))


def turn(
    model, pool, sessions, ids, item=None, user="alice", session="s1", memories=("m1",), sampling=GREEDY
):
    """One turn of a session, as the backend runs it: take the entry, start from its pages when they cover
    more than the block does, run, keep the table. Returns (the sequence, tokens reused, the entry taken)."""
    lease = sessions.take(user, session, item.item_id if item else None, memories)
    reused = usable_prefix_tokens(item, ids) if item is not None else 0
    n = sessions.reuse(lease, ids, reused)
    source = (lease.entry.cache, n) if n else None
    taken = lease.entry
    seq = admitted(pool, model, ids, item=None if source else item, source=source, sampling=sampling)
    assert seq.table.from_session == (source is not None)  # what usage's cached_tokens reads (steps.py)
    finish(model, pool, seq)
    table = seq.keep_table()
    fed = (*ids, *seq.stats.token_ids)[: table.length]
    assert sessions.put(lease, fed, table)
    seq.release()
    return seq, n, taken


def in_use(pool, sessions) -> set[int]:
    """The pages the resident items and the live sessions hold."""
    items = {p for e in pool.shared._entries.values() for p in e.pages}
    return items | {p for key in sessions.keys() for p in sessions.peek(*key).cache.pages}


def test_a_sessions_next_turn_references_its_pages_and_answers_as_a_full_prefill(tiny_handle, tokenizer):
    model = tiny_handle.model
    pool = make_pool(model)
    sessions = SessionCache(1 << 30)
    pool.reclaimers.append(sessions)
    first_ids, item = prompts_and_blocks(tiny_handle, tokenizer)[0]
    first, n1, _ = turn(model, pool, sessions, first_ids, item)
    assert n1 == 0 and first.stats.reused_tokens == len(item.token_ids)  # the block's pages, no session yet
    entry = sessions.peek("alice", "s1")
    assert isinstance(entry.cache, PageTable) and entry.cache.length == len(entry.ids)
    kept = list(entry.cache.pages)
    assert pool.used_pages == len(in_use(pool, sessions))
    # the next turn: the whole history is a prefix of its prompt
    second_ids = [*entry.ids, *first.stats.token_ids[-1:], *tokenizer.encode(" And my dog?")]
    second, n2, taken = turn(model, pool, sessions, second_ids, item)
    assert taken is entry and n2 == len(entry.ids)
    pt = pool.page_tokens
    assert second.stats.reused_tokens == n2 and second.stats.prefilled_tokens == len(second_ids) - n2
    new = sessions.peek("alice", "s1").cache
    assert new.shared_pages == n2 // pt and new.pages[: n2 // pt] == kept[: n2 // pt]  # by reference
    assert new.item_pages == entry.cache.item_pages == len(item.token_ids) // pt
    assert second.stats.token_ids == list(generate(model, second_ids, sampling=GREEDY))  # a full prefill's
    # the first turn's entry was replaced: its own pages went, those the second references stayed
    assert entry.cache.pages == [] and pool.used_pages == len(in_use(pool, sessions))
    assert all(pool.refs(p) == 1 for p in kept[len(item.token_ids) // pt : n2 // pt])  # the new entry's
    sessions.forget("alice")
    assert sessions.keys() == [] and pool.used_pages == pool.shared.page_count()
    assert pool.shared.drop(item.item_id) and pool.used_pages == 0


def test_entries_dropped_replaced_or_of_another_variant_give_their_pages_back(tiny_handle, tokenizer):
    model = tiny_handle.model
    pool = make_pool(model)
    sessions = SessionCache(1 << 30, max_per_user=2)
    ids = prompts_and_blocks(tiny_handle, tokenizer)[3][0]
    for session in ("s1", "s2", "s3"):  # the third drops the first (two per user)
        turn(model, pool, sessions, ids, session=session)
    assert sessions.keys() == [("alice", "s2"), ("alice", "s3")]
    assert pool.used_pages == len(in_use(pool, sessions)) > 0
    lease = sessions.take("alice", "s2", None, [], variant="adapter@v1")  # made without it: dropped
    assert lease.entry is None and pool.used_pages == len(in_use(pool, sessions))
    sessions.release(lease)
    lease = sessions.take("alice", "s3", None, [])  # taken, then the request failed: it goes
    sessions.release(lease)
    assert sessions.keys() == [] and pool.used_pages == 0
    turn(model, pool, sessions, ids, session="s4")
    lease = sessions.take("alice", "s4", None, ["m1"])
    assert sessions.forget("alice", ["m1"]) == [] and lease.stale  # running: marked, not put back
    table = PageTable.admit(pool, 40)
    table.length = 5
    assert not sessions.put(lease, list(range(5)), table)
    assert table.pages == [] and pool.used_pages == 0  # the taken entry and the refused table both closed


def test_a_short_pool_drops_live_sessions_before_a_request_waits(tiny_handle, tokenizer):
    model = tiny_handle.model
    ids = prompts_and_blocks(tiny_handle, tokenizer)[3][0]
    shape = PoolShape.of_model(model, 16)
    need = -(-(len(ids) + GREEDY.max_new_tokens) // 16)
    pool = PagePool(shape, (2 * need + 1) * shape.page_bytes)  # room for two sessions' turns, not three
    sessions = SessionCache(1 << 30)
    pool.reclaimers.append(sessions)
    turn(model, pool, sessions, ids, session="s1")
    turn(model, pool, sessions, ids, user="bob", session="s1")
    assert sessions.keys() == [("alice", "s1"), ("bob", "s1")]
    seqs, errors = run_engine(model, pool, [(ids, None)], [GREEDY], [0])  # needs pages a session holds
    assert errors == [] and seqs[0].stats.token_ids == list(generate(model, ids, sampling=GREEDY))
    assert sessions.keys() == [("bob", "s1")] and sessions.stats.dropped == 1  # the least recent went
    seqs[0].release()
    assert pool.used_pages == len(in_use(pool, sessions))


def test_a_short_pool_drops_unread_blocks_before_live_sessions(tiny_handle, tokenizer):
    """An unread block's pages go first: a session (the costlier to lose: its turns must be prefilled again)
    is dropped only when they are not enough."""
    model = tiny_handle.model
    requests = prompts_and_blocks(tiny_handle, tokenizer)
    ids, item = requests[3][0], requests[2][1]
    shape = PoolShape.of_model(model, 16)
    need = -(-(len(ids) + GREEDY.max_new_tokens) // 16)
    block = -(-item.num_tokens // 16)
    pool = PagePool(shape, (need + block + need // 2) * shape.page_bytes)
    sessions = SessionCache(1 << 30)
    pool.reclaimers.append(sessions)
    read = pool.shared.acquire(item)
    pool.shared.release(read.entry)  # resident, read by nobody
    turn(model, pool, sessions, ids, session="s1")
    assert item.item_id in pool.shared and sessions.keys() == [("alice", "s1")]
    seqs, errors = run_engine(model, pool, [(ids, None)], [GREEDY], [0])
    assert errors == [] and item.item_id not in pool.shared  # the unread block went
    assert sessions.keys() == [("alice", "s1")]  # the session stayed: the block's pages were enough
    seqs[0].release()
    assert pool.used_pages == len(in_use(pool, sessions))
