"""Fair sharing of the page pool (serving/engine/residency.py, issue 44 item 6): every page kept for a user (their
resident blocks, cached prompt pages, live sessions) is charged to them once, exactly; a per-user quota holds at
every step while users of different prompt lengths run at once; a pinned user's pages survive others' pressure
(an unpinned one's do not); the "heat" policy evicts the coldest user's pages first where LRU takes the oldest."""

from __future__ import annotations

import pytest

from kvmem.kv import Sampling, build_item, generate
from serving.engine.batcher import Batcher
from serving.engine.pages import PagePool, PoolShape
from serving.engine.prefix_cache import PrefixKey
from serving.engine.sequence import AdmissionWait, EngineSequence, admit
from serving.engine.sessions import SessionCache
from tests.conftest import prompts_and_blocks
from tests.serving.engine.test_prefix_cache import run_turn

MAX_NEW = 12


def owned_by(handle, item, user: str):
    """The same block as `user`'s item (prompts_and_blocks builds them for user "u")."""
    return build_item(handle, list(item.token_ids), user_id=user, memory_ids=list(item.meta.memory_ids))


def user_steps(pool, model, ids, item, user, out, sessions=None):
    """A request as steps.py runs one (reduced): admitted with its user's prefix key, its tokens, its full pages
    cached at the end; with `sessions`, its table kept as the user's session ("s1")."""
    seq = None
    sampling = Sampling(max_new_tokens=MAX_NEW)
    lease = None
    try:
        key = PrefixKey(user, item.item_id if item else None)
        for seq in admit(pool, model, ids, item=item, prefix=key, max_new_tokens=MAX_NEW, sampling=sampling):
            if isinstance(seq, AdmissionWait):
                yield seq
        token = yield seq
        while token is not None:
            out.append(token)
            token = yield
        seq.cache_prefix()
        if sessions is not None:  # taken at the end: the entry is kept, not read, while the request runs
            lease = sessions.take(user, "s1", item.item_id if item else None, ())
            table = seq.keep_table()
            sessions.put(lease, (*ids, *seq.stats.token_ids)[: table.length], table)
            lease = None
    finally:
        if lease is not None:
            sessions.release(lease)
        if seq is not None:
            seq.release()


def charged(pool, sessions, user) -> set[int]:
    """The pages kept for `user`, from the holders themselves: their resident items' pages, their cached
    prefix pages, their session tables' pages."""
    pages = {p for e in pool.shared._entries.values() if e.user == user for p in e.pages}
    pages |= set(pool.prefix.pages(user))
    for key in sessions.keys():
        if key[0] == user:
            pages |= set(sessions.peek(*key).cache.pages)
    return pages


def test_quotas_hold_at_every_step_while_users_of_different_prompt_lengths_run_at_once(
    tiny_handle, tokenizer
):
    model = tiny_handle.model
    cases = prompts_and_blocks(tiny_handle, tokenizer)
    shape = PoolShape.of_model(model, 16)
    pool = PagePool(shape, 160 * shape.page_bytes)
    quota = 12  # pages: less than one user's long block (15 pages), more than the short one's (7)
    pool.residency.configure(quota * shape.page_bytes)
    sessions = SessionCache(1 << 30)
    pool.reclaimers.append(sessions)
    users = {  # prompts of 134, 391, 248, 51 tokens
        "ann": (cases[2][0], owned_by(tiny_handle, cases[2][1], "ann")),
        "ben": cases[1],
        "cat": (cases[0][0], owned_by(tiny_handle, cases[0][1], "cat")),
        "dan": cases[3],
    }
    alone = {
        u: list(generate(model, ids, sampling=Sampling(max_new_tokens=MAX_NEW)))
        for u, (ids, _) in users.items()
    }
    seen_max = {u: 0 for u in users}

    def check() -> None:
        usage = pool.residency.usage()
        for u in users:
            assert usage.get(u, 0) == len(charged(pool, sessions, u))  # exact: each page once
            assert usage.get(u, 0) <= quota
            seen_max[u] = max(seen_max[u], usage.get(u, 0))
        held = set().union(*(charged(pool, sessions, u) for u in users))
        running = {p for s in seqs for p in s.table.pages}
        assert pool.used_pages == len(held | running)  # nothing else holds a page

    for round_ in range(2):
        batcher, outs, seqs = Batcher(prefill_budget_tokens=64), {}, []
        for user, (ids, item) in users.items():
            outs[user] = []
            steps = user_steps(pool, model, ids, item, user, outs[user], sessions if user == "ann" else None)
            seq = next(steps)
            assert isinstance(seq, EngineSequence)
            batcher.add(seq, steps)
            seqs.append(seq)
            check()
        while len(batcher):
            batcher.step()
            check()
        seqs = []
        check()
        assert outs == alone, f"round {round_}"
    assert max(pool.residency.peak.values()) <= quota
    assert seen_max["ben"] == quota  # the quota bound: his 391-token prompt's pages are more
    assert users["cat"][1].item_id not in pool.shared  # cat's block is over the quota by itself: not kept
    assert pool.shared.resident(users["ann"][1].item_id) is not None  # ann's fits, with her session's pages
    assert sessions.keys() == [("ann", "s1")]


def pressure(tiny_handle, tokenizer, pin: bool):
    """Alice's block and cached turn, then Carl's cached turn, stay unread in the pool; then Bob's long request
    needs 3 pages more than are free. Returns (Alice's cached pages before, after, whether her block is still
    resident, Carl's cached pages before, after, Bob's sequence, his prompt)."""
    model = tiny_handle.model
    cases = prompts_and_blocks(tiny_handle, tokenizer)
    ids, item = cases[2][0], owned_by(tiny_handle, cases[2][1], "alice")
    carl, other = cases[3][0], cases[1][0]
    shape = PoolShape.of_model(model, 16)
    alice_key, carl_key = PrefixKey("alice", item.item_id), PrefixKey("carl")

    def kept_alone(prompt, block, key) -> int:
        scratch = PagePool(shape, 256 * shape.page_bytes)
        run_turn(model, scratch, prompt, block, key)
        return scratch.used_pages

    kept, carl_kept = kept_alone(ids, item, alice_key), kept_alone(carl, None, carl_key)
    need = -(-(len(other) + 6) // 16)
    assert carl_kept >= 3
    pool = PagePool(shape, (kept + carl_kept + need - 3) * shape.page_bytes)
    pool.residency.configure(64 * shape.page_bytes)
    if pin:
        pool.residency.pin("alice")
    run_turn(model, pool, ids, item, alice_key)
    run_turn(model, pool, carl, key=carl_key)
    alice, carl_pages = pool.prefix.pages("alice"), pool.prefix.pages("carl")
    assert pool.used_pages == kept + carl_kept and pool.residency.pages_of("alice") == kept
    bob = run_turn(model, pool, other, key=PrefixKey("bob"))
    return (
        alice,
        pool.prefix.pages("alice"),
        item.item_id in pool.shared,
        carl_pages,
        pool.prefix.pages("carl"),
        bob,
        other,
    )


def test_a_pinned_user_keeps_their_pages_under_others_pressure(tiny_handle, tokenizer):
    before, after, block, carl_before, carl_after, bob, other = pressure(tiny_handle, tokenizer, pin=True)
    assert after == before and block  # nothing of Alice's was evicted for Bob
    assert len(carl_after) == len(carl_before) - 3  # Carl's unread pages went instead (his chain's tail)
    assert bob.stats.token_ids == list(
        generate(tiny_handle.model, other, sampling=Sampling(max_new_tokens=6))
    )
    # unpinned, the same pressure takes Alice's block first (unread, the oldest), and Carl keeps his
    before, after, block, carl_before, carl_after, _, _ = pressure(tiny_handle, tokenizer, pin=False)
    assert not block and carl_after == carl_before


def test_the_heat_policy_evicts_the_coldest_users_pages_first_where_lru_takes_the_oldest(
    tiny_handle, tokenizer
):
    model = tiny_handle.model
    ids = prompts_and_blocks(tiny_handle, tokenizer)[3][0]
    shape = PoolShape.of_model(model, 16)
    for policy, first_gone in (("lru", "hot"), ("heat", "cold")):
        pool = PagePool(shape, 64 * shape.page_bytes)
        pool.residency.configure(None, policy, heat={"hot": 5.0, "cold": 0.1}.get)
        run_turn(model, pool, ids, key=PrefixKey("hot"))  # the older
        run_turn(model, pool, ids, key=PrefixKey("cold"))
        assert pool.residency.evict_one()
        left = {u: len(pool.prefix.pages(u)) for u in ("hot", "cold")}
        other = "cold" if first_gone == "hot" else "hot"
        assert left[first_gone] < left[other], policy
    with pytest.raises(ValueError, match="unknown KV eviction policy 'mru'"):
        pool.residency.configure(None, "mru")
    with pytest.raises(ValueError, match="holds no page"):
        pool.residency.configure(100)


def test_an_eviction_reads_cached_heat_and_the_refresher_asks_again_outside_the_lock(tiny_handle, tokenizer):
    """Under "heat", a user's heat is asked once under the pool's lock (the first eviction that ranks them);
    after that evictions read the cached number, and `refresh_heat` (the daemon's round) asks again, for the
    users holding pages, with the pool's lock free."""
    model = tiny_handle.model
    ids = prompts_and_blocks(tiny_handle, tokenizer)[3][0]
    shape = PoolShape.of_model(model, 16)
    pool = PagePool(shape, 64 * shape.page_bytes)
    table = {"a": 5.0, "b": 0.1}
    asked: list[tuple[str, bool]] = []

    def heat(user: str) -> float:
        locked = _held_elsewhere(pool.lock)
        asked.append((user, locked))
        return table[user]

    pool.residency.configure(None, "heat", heat=heat)
    for user in ("a", "b"):
        run_turn(model, pool, ids, key=PrefixKey(user))
    assert pool.residency.evict_one()  # b, the colder: each asked once, under the lock
    assert sorted(asked) == [("a", True), ("b", True)]
    asked.clear()
    table.update(a=0.01, b=9.0)  # the scheduler's numbers change: a is colder now
    assert pool.residency.evict_one()
    assert asked == []  # the cached numbers: b still colder
    assert len(pool.prefix.pages("a")) > 0
    pool.residency.refresh_heat()
    assert sorted(asked) == [(u, False) for u in sorted(pool.residency.usage())]
    while len(pool.prefix.pages("a")) and pool.residency.evict_one():
        pass
    assert len(pool.prefix.pages("a")) == 0 and len(pool.prefix.pages("b")) > 0  # a went first now


def _held_elsewhere(lock) -> bool:
    """Whether `lock` (an RLock) is held at all: from another thread, a non-blocking acquire fails."""
    import threading

    out: list[bool] = []
    t = threading.Thread(target=lambda: out.append(lock.acquire(blocking=False) and (lock.release() or True)))
    t.start()
    t.join()
    return not out[0]
