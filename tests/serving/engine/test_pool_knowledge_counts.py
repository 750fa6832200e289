"""A knowledge child's pages at admission (wave 4, third review): a request that can never be admitted over a
child is a 400, its parent's last page counted (sequence.py `pages_needed`, SharedPages.reader_pages); a child
not resident over a resident parent copies in only its own pages (table.py, SharedPages.copy_in_pages), so a
request that fits is not refused."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvmem.kv import Sampling
from kvmem.kv.knowledge import KNOWLEDGE_OWNER
from serving.engine.errors import PoolTooSmall
from serving.engine.pages import PoolFull
from serving.engine.sequence import EngineSequence, admit, pages_needed
from serving.engine.table import PageTable
from tests.serving.engine.test_prefix_cache import small_pool


class Item:
    def __init__(self, item_id, n, user, parent=None, own_start=0):
        self.item_id, self.num_tokens, self.parent, self.own_start = item_id, n, parent, own_start
        self.token_ids = tuple(range(n))
        self.meta = SimpleNamespace(user_id=user)

    def kv_range(self, start, end):
        return torch.zeros(1, 2, 1, end - start, 4)


def test_a_request_over_a_knowledge_child_that_could_never_be_admitted_is_400():
    pool = small_pool(5)  # 4-token pages
    parent = Item("K", 6, KNOWLEDGE_OWNER)  # 2 pages, the last one partly filled
    child = Item("C", 12, "alice", parent=parent, own_start=6)  # K's full page + 2 of its own
    # 5 pages of its own table, the child's 3, K's second: 6 > 5, though the table reads the child's 3
    assert pages_needed(pool, 20, child, 12) == 6
    gen = admit(
        pool,
        torch.nn.Linear(1, 1),
        list(range(17)),
        item=child,
        max_new_tokens=3,
        wait_s=0.5,
        sampling=Sampling(max_new_tokens=3),
    )
    try:
        with pytest.raises(PoolTooSmall):
            next(gen)
    finally:
        gen.close()


def test_a_knowledge_childs_copy_in_counts_only_its_own_pages():
    pool = small_pool(6)  # 4-token pages
    parent = Item("K", 8, KNOWLEDGE_OWNER)  # 2 full pages
    child = Item("C", 12, "alice", parent=parent, own_start=8)  # K's 2 pages + 1 of its own
    reader = pool.shared.acquire(parent)  # another request reads the knowledge (a block-less prompt)
    running = pool.alloc(1)  # another request's own page
    assert pool.free_pages == 3 and pool.shared.copy_in_pages(child) == 1
    try:  # a 13-token prompt over the child: 1 page to copy the child's own tokens in, 1 for the prompt's rest
        table = PageTable.admit(pool, 13, item=child, reuse=12)
    except PoolFull as full:
        raise AssertionError(f"refused with 3 free pages for a request that needs 2: {full}") from None
    assert pool.free_pages == 1
    table.close()
    pool.release(running)
    pool.shared.release(reader.entry)
    assert pool.shared.copy_in_pages(child) == 0  # resident now (unread)


def test_parent_not_referenced_is_not_held():
    pool = small_pool(5)  # 4-token pages
    parent = Item("K", 3, KNOWLEDGE_OWNER)  # 1 partly filled page
    child = Item("C", 12, "alice", parent=parent, own_start=3)  # references no full parent page
    # a 13-token prompt over the child, 3 new tokens: 16 positions = 4 pages; the child's 3 pages read
    need = pages_needed(pool, 16, child, 12)
    table = PageTable.admit(pool, 13, item=child, reuse=12)
    try:
        held = pool.shared.held_pages(table._shared)
        pool.shared.evict(pool.num_pages)  # the unread parent goes: the child does not read it
        assert "K" not in pool.shared
        table._grow(16)  # the reply's page: the sequence at its longest
        at_longest = len(set(table.pages) | held)
        assert need == at_longest, f"pages_needed {need} but the request holds {at_longest} at its longest"
    finally:
        table.close()


def test_a_request_that_fits_is_not_400():
    pool = small_pool(4)
    parent = Item("K", 3, KNOWLEDGE_OWNER)
    child = Item("C", 12, "alice", parent=parent, own_start=3)
    gen = admit(
        pool,
        torch.nn.Linear(1, 1),
        list(range(13)),
        item=child,
        max_new_tokens=3,
        wait_s=0.2,
        sampling=Sampling(max_new_tokens=3),
    )
    try:
        seq = next(gen)  # PoolTooSmall (400) here, though it fits (see below)
        assert isinstance(seq, EngineSequence)
        assert seq.table.grow(16), "its longest fits: the unread parent is evicted"
        seq.release()
    finally:
        gen.close()
