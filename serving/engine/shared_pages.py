"""Resident items' pages in the page pool (pages.py): a stored block item is copied into pages on its first
request and read by reference after; a knowledge parent's full pages are referenced by each child built on it.
Under the pool's lock."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import NamedTuple

from serving.engine.errors import PoolFull


@dataclass
class _Entry:
    pages: list[int]  # the pool's reference to each (the entry's own), covering tokens [0, tokens)
    tokens: int
    item_id: str = ""
    users: int = 0  # readers now: sequences, session tables, resident children
    parent: _Entry | None = None  # the knowledge parent whose full pages it references
    user: str = ""  # the item's owner, charged its own pages (residency.py)
    charged: tuple[int, ...] = ()  # the pages charged to `user`: past the parent's
    tick: int = 0  # its last use (residency.py's order)


class SharedRead(NamedTuple):
    """One reader's share of a resident item: its pages, its tokens, and the entry the reader holds, which
    `release` and `hold` take (not the item's id: an item dropped and rebuilt under the same id while this
    reader reads is a new entry, whose readers this one's release must not touch)."""

    pages: list[int]
    tokens: int
    entry: _Entry


class SharedPages:
    """Resident items' pages: an item is copied into pages on its first request and read by reference after.

    A child of a knowledge parent references the parent's full pages and owns the rest (from the last full
    parent page on); it counts as a reader of its parent while it is resident, so a parent is never evicted
    before its children. Entries nobody reads stay until their pages are needed (LRU) or their item is
    dropped. The distinct pages of resident entries and the pages of unread ones are counted as entries come,
    go and change readers (`page_count`, `unread_pages`: O(1))."""

    category = 0  # evicted first (residency.py)

    def __init__(self, pool) -> None:  # pages.PagePool, which makes it
        self.pool = pool
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._holders = [0] * pool.num_pages  # resident entries holding each page
        self._distinct = 0  # pages with a holder
        self._unread = 0  # pages of resident entries nobody reads (each entry's, summed)

    def page_count(self) -> int:
        """Distinct pages held by resident items."""
        with self.pool.lock:
            return self._distinct

    def unread_pages(self) -> int:
        """Pages of resident items nobody reads (an upper bound of what evicting them all frees)."""
        with self.pool.lock:
            return self._unread

    def __contains__(self, item_id: str) -> bool:
        with self.pool.lock:
            return item_id in self._entries

    def resident(self, item_id: str) -> _Entry | None:
        """The item's resident entry, or None (`hold` it to keep it resident)."""
        with self.pool.lock:
            return self._entries.get(item_id)

    def held_pages(self, entry: _Entry | None) -> set[int]:
        """The pages a reader of `entry` keeps from being evicted: the entry's and its parents'."""
        pages: set[int] = set()
        while entry is not None:
            pages.update(entry.pages)
            entry = entry.parent
        return pages

    def _parent_full(self, item) -> int:
        """The full pages of `item`'s knowledge parent it references (0: none, or no parent: `_entry`)."""
        if item.parent is None:
            return 0
        return min(item.own_start, item.parent.num_tokens) // self.pool.page_tokens

    def copy_in_pages(self, item) -> int:
        """The pages `acquire(item)` would take from the pool now: none for a resident item; else its own, past
        the full pages of its knowledge parent it references, and its parent's if that is not resident either."""
        with self.pool.lock:
            if item.item_id in self._entries:
                return 0
            full = self._parent_full(item)  # a parent it references none of is copied in unread: evictable
            return self.pool.pages_for(item.num_tokens) + (
                self.copy_in_pages(item.parent) - full if full else 0
            )

    def reader_pages(self, item) -> int:
        """The pages a reader of `item` keeps resident (`held_pages` of its entry, whether resident or not): its
        own and its parents' (a child references its parent's full pages, not the last one partly filled)."""
        full = self._parent_full(item)  # a child that references none of its parent's pages does not read it
        return self.pool.pages_for(item.num_tokens) + (self.reader_pages(item.parent) - full if full else 0)

    def _is_resident(self, entry: _Entry) -> bool:
        return self._entries.get(entry.item_id) is entry

    def _read(self, entry: _Entry) -> None:
        if entry.users == 0 and self._is_resident(entry):
            self._unread -= len(entry.pages)
        entry.users += 1
        entry.tick = self.pool.residency.tick()

    def acquire(self, item) -> SharedRead:
        """The pages of `item` and its tokens, one more reader; copies it into pages if it is not resident.
        `release(read.entry)` when done. Raises PoolFull if there is no room."""
        with self.pool.lock:
            entry = self._entry(item)
            self._read(entry)
            self._entries.move_to_end(item.item_id)
            return SharedRead(entry.pages, entry.tokens, entry)

    def hold(self, entry: _Entry) -> bool:
        """One more reader of `entry` (a session's next turn over its pages) while it is still the resident
        entry of its item; False once it was dropped (even if its item is resident again, as a new entry)."""
        with self.pool.lock:
            if not self._is_resident(entry):
                return False
            self._read(entry)
            self._entries.move_to_end(entry.item_id)
            return True

    def release(self, entry: _Entry) -> None:
        """One reader of `entry` is done: exactly the entry it took, resident or dropped since."""
        with self.pool.lock:
            entry.users -= 1
            assert entry.users >= 0, f"item {entry.item_id} released more often than read"
            if entry.users == 0 and self._is_resident(entry):
                self._unread += len(entry.pages)
                self.pool.changed()  # evictable now
                self.pool.residency.enforce(entry.user)  # a copy-in outside an admission (a prewarm) too

    def drop(self, item_id: str) -> bool:
        """The item is gone (deleted, evicted from the store): its pages go once its readers are done."""
        with self.pool.lock:
            entry = self._entries.get(item_id)
            if entry is None:
                return False
            if entry.users == 0:
                self._unread -= len(entry.pages)
            del self._entries[item_id]
            self.pool.residency.remove(entry.user, entry.charged)
            for p in entry.pages:
                self._holders[p] -= 1
                if self._holders[p] == 0:
                    self._distinct -= 1
            self.pool.release(entry.pages)
            if entry.parent is not None:
                self.release(entry.parent)
                entry.parent = None
            return True

    def candidates(self, user: str | None = None, unread: bool = True):
        """(tick, user, item id) of its entries, least recently used first (residency.py's Holder)."""
        for e in self._entries.values():  # in the order of their last acquire or hold
            if (user is None or e.user == user) and (not unread or e.users == 0):
                yield e.tick, e.user, e.item_id

    def drop_key(self, item_id: str) -> None:
        self.drop(item_id)

    def holds(self, page: int) -> bool:
        """Whether a resident entry holds `page` (the prefix cache never takes such a page: prefix_cache.py)."""
        with self.pool.lock:
            return self._holders[page] > 0

    def simulate_eviction(self, sim, pinned: set[str]) -> None:
        """Into `sim` (residency.FreeSim): drop every entry of a user not pinned that nobody reads once what
        `sim` dropped before is gone; a child dropped lets go of its parent (the next pass may drop it)."""
        for e in self._entries.values():
            if e.user not in pinned and sim.readers(e) == 0 and sim.take(("item", id(e))):
                sim.drop(e.pages)
                if e.parent is not None:
                    sim.unread(e.parent)

    def surely_freeable(self, need: int, pinned: set[str]) -> int:
        """Up to `need`: pages that evicting its unread entries of users not pinned surely frees (only the
        entry holds them), least recently used first; stops once it counted `need`."""
        n = 0
        for e in self._entries.values():
            if n >= need:
                break
            if e.users == 0 and e.user not in pinned:
                n += sum(1 for p in e.pages if self.pool.refs(p) == 1)
        return n

    def evict(self, pages_wanted: int) -> None:
        """Drop unread entries, least recently used first, until `pages_wanted` more pages are free or none is
        left. Each victim is the first unread entry in LRU order: a pass over the entries read now (requests move
        theirs to the end), not over every entry per victim."""
        with self.pool.lock:
            goal = self.pool.free_pages + pages_wanted
            while self.pool.free_pages < goal:
                victim = next((e for e in self._entries.values() if e.users == 0), None)
                if victim is None:
                    return
                self.drop(victim.item_id)

    def _entry(self, item) -> _Entry:
        entry = self._entries.get(item.item_id)
        if entry is not None:
            return entry
        pt = self.pool.page_tokens
        pages: list[int] = []
        parent_entry, start = None, 0
        if item.parent is not None:
            parent = self._entry(item.parent)
            full = min(item.own_start, parent.tokens) // pt  # the parent's full pages this child starts with
            if full:
                parent_entry = parent
                self._read(parent)  # the child reads the parent's pages as long as it is resident
                pages = list(parent.pages[:full])
                self.pool.ref(pages)
                start = full * pt
        try:
            own = self.pool.alloc(self.pool.pages_for(item.num_tokens) - len(pages))
        except PoolFull:
            if pages:
                self.pool.release(pages)
                self.release(parent_entry)
            raise
        pages += own
        if item.num_tokens > start:
            self.pool.write(
                self.pool.slots(pages, start, item.num_tokens), item.kv_range(start, item.num_tokens)
            )
        entry = _Entry(pages, item.num_tokens, item_id=item.item_id, parent=parent_entry)
        entry.user = getattr(getattr(item, "meta", None), "user_id", "")
        entry.charged = tuple(pages[start // pt :])
        entry.tick = self.pool.residency.tick()
        self.pool.residency.add(entry.user, entry.charged)
        self._entries[item.item_id] = entry
        for p in pages:
            if self._holders[p] == 0:
                self._distinct += 1
            self._holders[p] += 1
        self._unread += len(pages)  # no reader yet: acquire makes it one
        return entry
