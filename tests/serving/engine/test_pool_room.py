"""What the pool can free for a request (review defects of wave 4): `make_room` counts what becomes evictable
only once something else goes (a block read only by an idle session's table: residency.py `freeable_pages`),
and a prefix page named by two keys is held once and evicted once nothing reads it (prefix_cache.py)."""

from __future__ import annotations

from kvmem.kv import Sampling, build_item
from kvmem.kv.inject import usable_prefix_tokens
from kvmem.kv.knowledge import KNOWLEDGE_OWNER
from serving.engine.pages import PagePool, PoolShape
from serving.engine.prefix_cache import PrefixKey
from serving.engine.sequence import EngineSequence, admit
from serving.engine.sessions import SessionCache
from tests.conftest import prompts_and_blocks
from tests.serving.engine.test_pool_fairness import try_admit
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
    assert pool.residency.reclaimable_pages() == len(table.pages) - table.item_pages
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
