"""What the pool can free for a request (review defects of wave 4): `make_room` counts what becomes evictable
only once something else goes (a block read only by an idle session's table: residency.py `freeable_pages`),
and a prefix page named by two keys is held once and evicted once nothing reads it (prefix_cache.py)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from kvmem.kv import Sampling, build_item
from kvmem.kv.inject import usable_prefix_tokens
from kvmem.kv.knowledge import KNOWLEDGE_OWNER
from serving.engine.pages import PagePool, PoolShape
from serving.engine.prefix_cache import PrefixKey, page_hashes
from serving.engine.sequence import EngineSequence, admit
from serving.engine.sessions import SessionCache
from serving.engine.table import PageTable
from tests.conftest import prompts_and_blocks
from tests.serving.engine.test_pool_fairness import try_admit
from tests.serving.engine.test_prefix_cache import small_pool
from tests.serving.engine.test_session_pages import finish


def keep_session(pool, model, sessions, ids, item, user="alice", session="s1") -> None:
    """A turn over `item`, its table kept as the user's live session (as steps.py does)."""
    lease = sessions.take(user, session, item.item_id, ())
    seq = next(admit(pool, model, ids, item=item, max_new_tokens=2, sampling=Sampling(max_new_tokens=2)))
    finish(model, pool, seq)
    table = seq.keep_table()
    assert sessions.put(lease, (*ids, *seq.stats.token_ids)[: table.length], table)
    seq.release()


def test_a_request_that_fits_once_an_idle_session_and_its_block_go_is_admitted(tiny_handle, tokenizer):
    model = tiny_handle.model
    ids, item = prompts_and_blocks(tiny_handle, tokenizer)[0]  # a long block of user "u"
    shape = PoolShape.of_model(model, 16)
    pool = PagePool(shape, 30 * shape.page_bytes)
    sessions = SessionCache(1 << 30)
    pool.reclaimers.append(sessions)
    keep_session(pool, model, sessions, ids, item)
    table = sessions.peek("alice", "s1").cache
    assert pool.used_pages == len(set(pool.shared.resident(item.item_id).pages) | set(table.pages))
    # the holders' own counts see the session's pages past the block's only; the block is read by the session
    assert pool.residency.surely_freeable(100) == len(table.pages) - table.item_pages
    assert pool.residency.freeable_pages() == pool.used_pages  # dropping the session frees the block too
    bob = [300 + i for i in range(20 * 16)]  # 20 of the 30 pages
    assert pool.free_pages < 20
    seq = try_admit(pool, model, bob)
    assert isinstance(seq, EngineSequence), seq
    assert sessions.keys() == [] and item.item_id not in pool.shared  # both evicted for it
    seq.release()
    # a pinned user's session (and the block only it reads) is never evicted: not counted either
    keep_session(pool, model, sessions, ids, item)
    pool.residency.pin("u")  # the block's owner
    pool.residency.pin("alice")
    assert pool.residency.freeable_pages() == 0
    used = pool.used_pages
    refused = try_admit(pool, model, bob)
    assert "this request needs 20" in str(refused) and pool.used_pages == used  # nothing evicted


def test_a_page_a_sessions_next_turn_caches_under_another_block_id_goes_once_nothing_reads_it(
    tiny_handle, tokenizer
):
    """A live session's next turn under another block id (the plan changed between turns, both served from
    the shared head: steps.py's fallback) starts from the session's pages and caches them under its own
    key: the page is named by two keys, held once, and evicted once the session and requests are gone."""
    model = tiny_handle.model
    shape = PoolShape.of_model(model, 16)
    pool = PagePool(shape, 64 * shape.page_bytes)
    sessions = SessionCache(1 << 30)
    pool.reclaimers.append(sessions)
    head = build_item(tiny_handle, [1] + [200 + i for i in range(39)], user_id=KNOWLEDGE_OWNER)

    def turn(ids, block_id):  # steps.py's flow for a request whose block is not served (item = the head)
        prefix = PrefixKey("alice", block_id, None, pool.prefix.epoch("alice", block_id))
        lease = sessions.take("alice", "s1", block_id, ())
        n = sessions.reuse(lease, ids, max(usable_prefix_tokens(head, ids), 0))
        sessions.trim(lease, n)
        source = (lease.entry.cache, n) if n else None
        seq = next(
            admit(
                pool,
                model,
                ids,
                item=head,
                source=source,
                prefix=prefix,
                max_new_tokens=4,
                sampling=Sampling(max_new_tokens=4),
            )
        )
        sessions.started(lease)
        finish(model, pool, seq)
        seq.cache_prefix()
        table = seq.keep_table()
        sessions.put(lease, (*ids, *seq.stats.token_ids)[: table.length], table)
        seq.release()
        return n

    block_text = [1000 + i for i in range(100)]
    turn([*head.token_ids, *block_text, *[3000 + i for i in range(20)]], "block-A")
    second = [*head.token_ids, *block_text, *[1500 + i for i in range(30)], *[3000 + i for i in range(25)]]
    assert turn(second, "block-A2") > 0  # it started from the session's pages
    keys_per_page: dict[int, int] = {}
    for cached in pool.prefix._index.values():
        keys_per_page[cached.page] = keys_per_page.get(cached.page, 0) + 1
    shared = [p for p, k in keys_per_page.items() if k == 2]
    assert shared  # pages named by both turns' keys
    assert len(pool.prefix) == len(keys_per_page)  # each held once
    for key in sessions.keys():
        sessions.drop_key(key)
    assert all(pool.refs(p) == 1 for p in shared)  # only the cache holds them: evictable
    while pool.residency.evict_one():
        pass
    assert pool.used_pages == 0 and len(pool.prefix) == 0


# -- model-free: a pool of 4-token pages, items with K/V of zeros ---------------------------------------------
class Item:
    """What SharedPages reads of a stored item."""

    def __init__(self, item_id: str, num_tokens: int, user: str, parent=None, own_start: int = 0) -> None:
        self.item_id, self.num_tokens, self.parent, self.own_start = item_id, num_tokens, parent, own_start
        self.meta = SimpleNamespace(user_id=user)

    def kv_range(self, start: int, end: int) -> torch.Tensor:
        return torch.zeros(1, 2, 1, end - start, 4)


def evict_all(pool) -> int:
    """Evict for room until nothing more may go: the pages it freed."""
    before = pool.free_pages
    while pool.residency.evict_one():
        pass
    return pool.free_pages - before


def keep_table(sessions, user: str, table: PageTable) -> None:
    lease = sessions.take(user, "s1", None, ())
    assert sessions.put(lease, list(range(table.length)), table)


def test_make_room_that_cannot_succeed_evicts_nothing_a_pinned_users_session_and_a_read_parent_included():
    pool = small_pool(6)
    sessions = SessionCache(1 << 30)
    pool.reclaimers.append(sessions)
    table = PageTable(pool)
    table.pages, table.length = pool.alloc(3), 12
    keep_table(sessions, "alice", table)
    pool.residency.pin("alice")  # her session is never evicted
    bob = PrefixKey("bob")
    pages = pool.alloc(2)
    assert pool.prefix.insert(bob, page_hashes(bob, list(range(8)), 4), pages, 0) == 2
    pool.release(pages)
    running = pool.alloc(1)
    assert pool.free_pages == 0 and pool.residency.freeable_pages() == 2
    assert pool.make_room(3) is False and len(pool.prefix) == 2  # bob's pages stay
    assert pool.make_room(2) is True and len(pool.prefix) == 0
    pool.release(running)
    # an unread knowledge child whose parent a running request reads frees its own page only
    pool = small_pool(6)
    parent = Item("K", 8, KNOWLEDGE_OWNER)
    child = Item("C", 12, "alice", parent=parent, own_start=8)
    reader = pool.shared.acquire(parent)
    pool.shared.release(pool.shared.acquire(child).entry)
    running = pool.alloc(3)
    assert pool.free_pages == 0 and pool.residency.freeable_pages() == 1
    assert pool.make_room(2) is False and "C" in pool.shared
    pool.release(running)
    pool.shared.release(reader.entry)


def test_a_page_a_pinned_users_key_names_is_not_freeable_though_another_users_key_is_evicted():
    pool = small_pool(4)
    page = pool.alloc(1)
    for user in ("alice", "bob"):
        key = PrefixKey(user)
        assert pool.prefix.insert(key, page_hashes(key, list(range(4)), 4), page, 0) == 1
    pool.release(page)
    running = pool.alloc(3)
    pool.residency.pin("alice")
    assert pool.residency.freeable_pages() == 0 == evict_all(pool)
    assert pool.prefix.pages() == page  # alice's key keeps it
    pool.release(running)


def test_a_resident_items_page_never_enters_the_prefix_cache():
    """A session's next turn whose table no longer holds the knowledge child it began from (dropped while its
    table read it: a quota, a delete) caches its pages; the parent's, still resident, stay the parent's alone:
    the stats add up, and what eviction frees is what freeable_pages says."""
    pool = small_pool(12)
    sessions = SessionCache(1 << 30)
    pool.reclaimers.append(sessions)
    parent = Item("K", 8, KNOWLEDGE_OWNER)
    child = Item("C", 12, "alice", parent=parent, own_start=8)
    first = PageTable.admit(pool, 16, item=child, reuse=12)
    first.length = 16
    pool.shared.drop("C")
    second = PageTable.admit(pool, 20, source=first, reuse=16)
    second.length = 20
    assert second.cache_prefix(PrefixKey("alice"), list(range(20))) == 3  # not K's two pages
    k_pages = pool.shared.resident("K").pages
    assert not set(k_pages) & set(pool.prefix.pages())
    first.close()
    second.close()
    bobs = PageTable.admit(pool, 12, item=parent, reuse=8)  # bob's idle session reads K
    bobs.length = 12
    keep_table(sessions, "bob", bobs)
    stats = pool.stats()
    assert stats["private_bytes"] >= 0
    assert pool.residency.freeable_pages() == pool.used_pages == evict_all(pool)
    assert pool.used_pages == 0
