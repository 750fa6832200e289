"""Automatic prefix reuse in the engine (serving/engine/prefix_cache.py, issue 44 item 5): a finished request's full
pages stay in the pool by a chained hash of their tokens, salted per user; the next turn of a chat finds them
with no session (exactly its history's full pages) and answers as a cold prefill; another user with the same
prompt finds nothing, a declared knowledge item's pages are shared; a changed block never matches; unread
cached pages are evicted under pressure (a chain from its tail) and requests stay correct, preempted ones too;
a delete drops the user's pages at once, and a request that began before it puts none back."""

from __future__ import annotations

import torch

from kvmem.kv import PromptLayout, Sampling, build_item, generate
from kvmem.kv.knowledge import KNOWLEDGE_OWNER
from serving.engine.batcher import Batcher
from serving.engine.pages import PagePool, PoolShape
from serving.engine.prefix_cache import PrefixKey, page_hashes
from serving.engine.sequence import AdmissionWait, EngineSequence, admit
from tests.conftest import prompts_and_blocks, synthetic_memories
from tests.serving.engine.test_engine import admitted, make_pool
from tests.serving.engine.test_session_pages import finish

GREEDY = Sampling(max_new_tokens=6)
ALICE = PrefixKey("alice")


def run_turn(model, pool, ids, item=None, key=ALICE, sampling=GREEDY):
    """One request as the backend runs it: admitted with its prefix key, run to its end, its full pages cached,
    its pages released. Returns the sequence (its table as it was at the end)."""
    seq = admitted(pool, model, ids, item=item, prefix=key, sampling=sampling)
    finish(model, pool, seq)
    seq.cache_prefix()
    seq.final_pages = list(seq.table.pages)
    seq.release()
    return seq


def next_turn(tokenizer, ids, seq, text=" And what about my dog?"):
    return [*ids, *seq.stats.token_ids, *tokenizer.encode(text)]


def test_a_chats_next_turn_reuses_its_pages_without_a_header_and_answers_as_a_cold_prefill(
    tiny_handle, tokenizer
):
    model, pool = tiny_handle.model, make_pool(tiny_handle.model)
    pt = pool.page_tokens
    ids, item = prompts_and_blocks(tiny_handle, tokenizer)[0]
    first = run_turn(model, pool, ids, item)
    assert first.stats.reused_tokens == len(item.token_ids)  # the block's, nothing cached yet
    written = len(ids) + len(first.stats.token_ids) - 1  # every token fed: the last reply token is not
    item_full = len(item.token_ids) // pt
    assert len(pool.prefix) == written // pt - item_full  # its full pages past the block's
    second_ids = next_turn(tokenizer, ids, first)
    second = admitted(pool, model, second_ids, item=item, prefix=PrefixKey("alice"), sampling=GREEDY)
    assert second.stats.reused_tokens == (written // pt) * pt  # exactly the history's full pages
    assert second.table.item_pages == item_full and second.table.cached_pages == written // pt - item_full
    assert pool.prefix.stats.hits == written // pt - item_full
    finish(model, pool, second)
    assert second.stats.token_ids == list(generate(model, second_ids, sampling=GREEDY))  # a cold prefill's
    second.release()
    # a prompt that is all cached (a retry of the same turn): the last page is copied, one token prefilled
    again = run_turn(model, pool, ids, item)
    assert again.stats.prefilled_tokens == len(ids) - max(len(item.token_ids), (len(ids) - 1) // pt * pt)
    assert again.stats.token_ids == first.stats.token_ids


def test_two_users_with_the_same_prompt_share_no_page_but_a_declared_knowledge_item(tiny_handle, tokenizer):
    model, pool = tiny_handle.model, make_pool(tiny_handle.model)
    layout = PromptLayout(tiny_handle.tokenizer)
    knowledge = build_item(
        tiny_handle, layout.block_ids(synthetic_memories(80, tokenizer, seed=5)), user_id=KNOWLEDGE_OWNER
    )
    ids = [*knowledge.token_ids, *tokenizer.encode(" " + " ".join(synthetic_memories(40, tokenizer, seed=6)))]
    alice = run_turn(model, pool, ids, knowledge, PrefixKey("alice"))
    alice_pages = set(pool.prefix.pages("alice"))
    assert alice_pages
    bob = admitted(pool, model, ids, item=knowledge, prefix=PrefixKey("bob"), sampling=GREEDY)
    pt = pool.page_tokens
    shared = len(knowledge.token_ids) // pt
    assert bob.table.cached_pages == 0 and bob.stats.reused_tokens == len(
        knowledge.token_ids
    )  # the item's only
    assert bob.table.pages[:shared] == alice.final_pages[:shared]  # the knowledge's pages, shared
    finish(model, pool, bob)
    bob.cache_prefix()
    bob.release()
    assert bob.stats.token_ids == alice.stats.token_ids
    assert alice_pages.isdisjoint(pool.prefix.pages("bob"))  # same tokens, each user's own pages
    assert set(pool.prefix.pages("alice")) == alice_pages
    # a user's hash chain never names another's: the roots differ by the salt
    assert set(page_hashes(PrefixKey("alice"), ids, pt)).isdisjoint(page_hashes(PrefixKey("bob"), ids, pt))


def test_a_changed_block_never_matches_its_old_pages(tiny_handle, tokenizer):
    """The block item's identity is the chain's root: after an edit (a new item), no page cached after the
    old block is found, even for a prompt with the same tokens after it."""
    model, pool = tiny_handle.model, make_pool(tiny_handle.model)
    ids = prompts_and_blocks(tiny_handle, tokenizer)[3][0]
    run_turn(model, pool, ids, None, PrefixKey("alice", block="item-v1"))
    same = admitted(pool, model, ids, prefix=PrefixKey("alice", block="item-v1"), sampling=GREEDY)
    assert same.table.cached_pages > 0
    same.release()
    edited = admitted(pool, model, ids, prefix=PrefixKey("alice", block="item-v2"), sampling=GREEDY)
    assert edited.table.cached_pages == 0 and edited.stats.reused_tokens == 0
    edited.release()
    under_adapter = admitted(
        pool, model, ids, prefix=PrefixKey("alice", "item-v1", "lora-1"), sampling=GREEDY
    )
    assert under_adapter.table.cached_pages == 0
    under_adapter.release()


def test_unread_cached_pages_are_evicted_tail_first_under_pressure_and_answers_stay_correct(
    tiny_handle, tokenizer
):
    model = tiny_handle.model
    requests = prompts_and_blocks(tiny_handle, tokenizer)
    ids, other = requests[3][0], requests[1][0]
    shape = PoolShape.of_model(model, 16)
    need_other = -(-(len(other) + GREEDY.max_new_tokens) // 16)
    pool = PagePool(shape, (need_other + 2) * shape.page_bytes)
    first = run_turn(model, pool, ids)
    cached = pool.prefix.pages("alice")
    assert len(cached) == (len(ids) + len(first.stats.token_ids) - 1) // 16
    assert pool.used_pages == len(cached)  # only the cache holds them: unread
    # another user's request needs all but 2 pages: alice's unread pages go, the chain's tail first
    bob = run_turn(model, pool, other, key=PrefixKey("bob"))
    assert bob.stats.token_ids == list(generate(model, other, sampling=GREEDY))
    kept = pool.prefix.pages("alice")
    assert len(kept) < len(cached) and kept == [p for p in cached if p in kept]
    hashes = page_hashes(PrefixKey("alice"), ids, 16)
    assert len(pool.prefix.lookup(hashes, 0)) == len(kept) or not kept  # what stays is the chain's head
    assert pool.prefix.stats.evicted >= len(cached) - len(kept)
    again = run_turn(model, pool, ids)
    assert again.stats.token_ids == first.stats.token_ids


def cached_steps(pool, model, ids, item, max_new: int, out: list, key: PrefixKey):
    """A request as steps.py runs one (reduced): admitted with its prefix key, its tokens, its full pages cached
    when it ends, then its pages released."""
    seq = None
    sampling = Sampling(max_new_tokens=max_new)
    try:
        for seq in admit(pool, model, ids, item=item, prefix=key, max_new_tokens=max_new, sampling=sampling):
            if isinstance(seq, AdmissionWait):
                yield seq
        token = yield seq
        while token is not None:
            out.append(token)
            token = yield
        seq.cache_prefix()
    finally:
        if seq is not None:
            seq.release()


def batched(pool, model, requests, max_new: int, keys):
    batcher = Batcher(prefill_budget_tokens=32)
    outs, seqs = [], []
    for (ids, item), key in zip(requests, keys, strict=True):
        out: list[int] = []
        steps = cached_steps(pool, model, ids, item, max_new, out, key)
        seq = next(steps)
        assert isinstance(seq, EngineSequence)
        batcher.add(seq, steps)
        outs.append(out)
        seqs.append(seq)
    while len(batcher):
        batcher.step()
        for s in seqs:  # no page a sequence reads (an item's, a cached one, its own) was freed from under it
            assert all(pool.refs(p) >= 1 for p in s.table.pages)
    return outs, seqs


def test_preempted_requests_over_cached_pages_end_with_their_tokens_alone(tiny_handle, tokenizer):
    """Three users' requests of different lengths (two over blocks), each cached by an earlier turn, run at
    once in a pool their replies do not fit: the newest are preempted and prefill again, the cached pages they
    read stay, unread ones are evicted for room, and every reply equals the request's alone."""
    model = tiny_handle.model
    cases = prompts_and_blocks(tiny_handle, tokenizer)
    requests = [cases[2], cases[3], cases[0]]
    keys = [PrefixKey(u) for u in ("ann", "ben", "cat")]
    max_new = 64
    shape = PoolShape.of_model(model, 16)
    alone = [
        batched(PagePool(shape, 256 * shape.page_bytes), model, [r], max_new, [k])[0][0]
        for r, k in zip(requests, keys, strict=True)
    ]
    pt = 16
    items = sum(-(-item.num_tokens // pt) for _, item in requests if item is not None)
    own = [-(-len(ids) // pt) for ids, _ in requests]
    # the blocks and the prompts fit at once (most of theirs cached), their 64-token replies do not
    pool = PagePool(shape, (items + sum(own) - 10) * shape.page_bytes)
    for r, k in zip(requests, keys, strict=True):  # an earlier, shorter turn of each: its pages cached
        batched(pool, model, [r], 8, [k])
    assert all(pool.prefix.pages(k.user) for k in keys)
    outs, seqs = batched(pool, model, requests, max_new, keys)
    assert outs == alone
    assert [s.num_preemptions for s in seqs] == [0, 0, 1]  # the newest admitted
    assert all(s.table.cached_pages > 0 for s in seqs)  # each started from its earlier turn's pages
    assert not pool.preempted
    cached = {p for k in keys for p in pool.prefix.pages(k.user)}
    items_pages = {p for e in pool.shared._entries.values() for p in e.pages}
    assert pool.used_pages == len(cached | items_pages)  # nothing else holds a page: no leak


def test_a_delete_drops_the_users_pages_at_once_and_a_request_begun_before_it_puts_none_back(
    tiny_handle, tokenizer
):
    model, pool = tiny_handle.model, make_pool(tiny_handle.model)
    ids = prompts_and_blocks(tiny_handle, tokenizer)[3][0]
    run_turn(model, pool, ids)
    run_turn(model, pool, ids, key=PrefixKey("bob"))
    bob_pages = pool.prefix.pages("bob")
    before = PrefixKey("alice", epoch=pool.prefix.epoch("alice"))
    running = admitted(pool, model, ids, prefix=before, sampling=GREEDY)  # reads alice's cached pages
    held = list(running.table.pages[: running.table.cached_pages])
    assert held
    assert pool.prefix.drop_user("alice") > 0
    assert pool.prefix.pages("alice") == []  # out of the index before the call returned
    assert all(pool.refs(p) == 1 for p in held)  # the reader's own references: freed when it is done
    finish(model, pool, running)
    assert running.cache_prefix() == 0  # it began before the delete: it may carry what was deleted
    running.release()
    assert pool.prefix.pages("alice") == [] and pool.prefix.pages("bob") == bob_pages
    assert pool.used_pages == len(bob_pages)


def small_pool(pages: int) -> PagePool:
    """A pool of `pages` pages of 4 tokens (one layer, one head: no model reads it)."""
    shape = PoolShape(layers=1, kv_heads=1, head_dim=4, dtype=torch.float32, page_tokens=4)
    return PagePool(shape, pages * shape.page_bytes)


def test_a_request_that_resolved_a_block_before_its_drop_puts_no_page_back_under_it():
    pool = small_pool(4)
    before = PrefixKey("bob", "blk", epoch=pool.prefix.epoch("bob", "blk"))
    other = PrefixKey("bob", "other", epoch=pool.prefix.epoch("bob", "other"))
    assert pool.prefix.drop_block("blk") == 0
    ids = list(range(8))
    pages = pool.alloc(2)
    assert pool.prefix.insert(before, page_hashes(before, ids, 4), pages, 0) == 0
    assert len(pool.prefix) == 0 and pool.free_pages == 2
    # another block's request is not kept out; one that began after the drop puts its pages in
    assert pool.prefix.insert(other, page_hashes(other, ids, 4), pages, 0) == 2
    after = PrefixKey("bob", "blk", epoch=pool.prefix.epoch("bob", "blk"))
    assert pool.prefix.insert(after, page_hashes(after, ids[:4], 4), pages, 0) == 1
    pool.release(pages)
    # three keys over two pages: the cache holds each page once (one reference, counted once)
    assert len(pool.prefix._index) == 3 and len(pool.prefix) == 2 and pool.free_pages == 2
    assert [pool.refs(p) for p in pages] == [1, 1]


def test_make_room_that_cannot_succeed_evicts_no_cached_page_still_read_or_pinned():
    pool = small_pool(4)
    ids = list(range(16))
    pages = pool.alloc(4)
    assert pool.prefix.insert(ALICE, page_hashes(ALICE, ids, 4), pages, 0) == 4
    pool.release(pages[:2])  # the first two are only the cache's now; a running request still reads the rest
    assert pool.free_pages == 0
    assert pool.make_room(3) is False  # 2 could be freed, not 3: nothing is evicted
    assert len(pool.prefix) == 4 and pool.free_pages == 0
    pool.residency.pinned.add("alice")  # a pinned user's pages are never evicted: not counted either
    assert pool.make_room(1) is False
    assert len(pool.prefix) == 4 and pool.free_pages == 0
    pool.residency.pinned.discard("alice")
    assert pool.make_room(2) is True  # what can be freed is: the two unread pages
    assert len(pool.prefix) == 2 and pool.free_pages == 2
    pool.release(pages[2:])
