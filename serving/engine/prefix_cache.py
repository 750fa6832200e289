"""Automatic prefix reuse: full pages of finished requests kept by a chained hash of their tokens, per user.

As vLLM's automatic prefix caching: a full page's key is a hash of the key of the page before it and of the
page's own tokens, so a key names a page's tokens *and every token before them*; the first page's "key before"
is a root that names whose K/V it is (`PrefixKey`): the user (a salt: no page is ever found by another user's
request; what users share is a declared knowledge item's pages, shared_pages.py), the block item the
prompt began with (its identity: a block that changed is a new item, so no page computed after the old one
matches) and the variant (an adapter: its K/V are the adapted model's). A request's next turn, whose prompt
extends the last one's, finds the pages of its history by their keys with no session header (sessions.py's
header is a hint: its table also covers a partly filled last page).

A request's pages go in when it ends (`insert`, its full pages past its item's: those are the item's entry's);
the cache holds one reference to each page it keeps, however many keys name it (a page a session's next turn
read under another block id goes in under that turn's keys too: its tokens are the same), and a page is
*unread* when that reference is its only one (no running sequence, session table or other holder reads it). Unread pages are evictable, least recently
used first and a chain's tail before its head (a page is touched after the pages that follow it, so a chain is
evicted from its end, and no page stays reachable only through a dropped one), through the pool's eviction
(residency.py). A delete drops the user's pages (`drop_user`: every page of the user, whatever the delete
named: a page's K/V carry every token before it) or a block's (`drop_block`) from the index before it returns;
pages still read go back once their readers are done. Under the pool's lock; knows nothing of HTTP or tiers.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class PrefixKey:
    """Whose K/V a prompt's pages are: the user, the block item it began with (None: none) and the variant."""

    user: str
    block: str | None = None
    variant: str | None = None
    epoch: int = 0  # the user's deletes + the block's drops at the request's start (`PrefixCache.epoch`)

    def root(self) -> bytes:
        parts = (self.user, self.block or "", self.variant or "")
        return hashlib.sha256("\x1f".join(parts).encode()).digest()


def page_hashes(key: PrefixKey, ids: Sequence[int], page_tokens: int) -> list[bytes]:
    """The chained key of each full page of `ids` (len(ids) // page_tokens of them)."""
    out, before = [], key.root()
    for start in range(0, len(ids) - page_tokens + 1, page_tokens):
        tokens = array("q", ids[start : start + page_tokens]).tobytes()
        before = hashlib.sha256(before + tokens).digest()
        out.append(before)
    return out


@dataclass
class _Cached:
    page: int
    user: str
    block: str | None
    tick: int


@dataclass
class PrefixStats:
    hits: int = 0  # pages found by a request's admission
    queries: int = 0  # pages looked up (a request stops at its first miss: the rest are not counted)
    inserted: int = 0
    evicted: int = 0  # unread pages dropped for room or a quota
    dropped: int = 0  # pages dropped by a delete


class PrefixCache:
    """The pool's cached full pages by chained key (see the module docstring)."""

    category = 1  # evicted after unread items (0), before live sessions (residency.py)

    def __init__(self, pool) -> None:  # pages.PagePool, which makes it
        self.pool = pool
        self._index: OrderedDict[bytes, _Cached] = OrderedDict()  # least recently used first
        self._keys: dict[int, int] = {}  # page -> how many keys name it (the cache's one reference each page)
        self._epochs: dict[str, int] = {}  # per user, bumped by each delete (`drop_user`)
        self._block_epochs: dict[str, int] = {}  # per block item, bumped by each drop (`drop_block`)
        self.stats = PrefixStats()

    def epoch(self, user: str, block: str | None = None) -> int:
        """The user's deletes plus the block's drops so far (both only grow: the sum changes with either): a
        request that began before one puts none of its pages in (`insert`)."""
        with self.pool.lock:
            return self._epochs.get(user, 0) + (0 if block is None else self._block_epochs.get(block, 0))

    def __len__(self) -> int:
        """The pages it holds (a page named by two keys counts once)."""
        with self.pool.lock:
            return len(self._keys)

    def pages(self, user: str | None = None) -> list[int]:
        """The pages it holds (of `user`), least recently used first, each once."""
        with self.pool.lock:
            found = (c.page for c in self._index.values() if user is None or c.user == user)
            return list(dict.fromkeys(found))

    def _touch(self, keys: Sequence[bytes]) -> None:
        """Most recently used now, the last key first: a chain is evicted from its tail."""
        for k in reversed(keys):
            self._index.move_to_end(k)
            self._index[k].tick = self.pool.residency.tick()

    def lookup(self, hashes: Sequence[bytes], first: int) -> list[int]:
        """The cached pages of hashes[first:], up to the first miss (touched: most recently used)."""
        with self.pool.lock:
            found: list[bytes] = []
            for h in hashes[first:]:
                if h not in self._index:
                    break
                found.append(h)
            self.stats.queries += min(len(found) + 1, len(hashes) - first)
            self.stats.hits += len(found)
            self._touch(found)
            return [self._index[h].page for h in found]

    def insert(self, key: PrefixKey, hashes: Sequence[bytes], pages: Sequence[int], first: int) -> int:
        """A request's full pages `pages[first:len(hashes)]` (holding the tokens `hashes` name) are kept: each not
        yet cached gets the cache's reference (one per page: a page already cached under another key gets no
        second). A key already cached under another page keeps that page (two requests computed the same tokens
        at once). Returns how many keys went in. The user's quota is
        enforced after (residency.py). Nothing goes in when a delete of the user's or a drop of the block came
        after `key.epoch` (the request may carry what it deleted, or the dropped block's K/V)."""
        with self.pool.lock:
            if key.epoch != self.epoch(key.user, key.block):
                return 0
            added, touched = [], []
            for i in range(first, min(len(hashes), len(pages))):
                h = hashes[i]
                # a resident item's page (a knowledge parent's, under a child the request's table no longer
                # holds) stays the item's alone: the cache and the items never share a page
                if h not in self._index and not self.pool.shared.holds(pages[i]):
                    page = pages[i]
                    if page not in self._keys:
                        self.pool.ref([page])
                    self._keys[page] = self._keys.get(page, 0) + 1
                    self._index[h] = _Cached(page, key.user, key.block, 0)
                    added.append(page)
                touched.append(h)
            self._touch([h for h in touched if h in self._index])
            self.stats.inserted += len(added)
            if added:
                self.pool.residency.add(key.user, added)
                self.pool.residency.enforce(key.user)
            return len(added)

    # -- eviction (residency.py) -----------------------------------------------------------------------------
    def candidates(self, user: str | None = None, unread: bool = True) -> Iterator[tuple[int, str, bytes]]:
        """(tick, user, key) of its pages, least recently used first: the unread ones (only the cache reads
        them), or all of `user`'s with `unread=False` (a quota drops pages still read: they just leave the
        index)."""
        for h, c in self._index.items():
            if (user is None or c.user == user) and (not unread or self.pool.refs(c.page) == 1):
                yield c.tick, c.user, h

    def surely_freeable(self, need: int, pinned: set[str]) -> int:
        """Up to `need`: pages that evicting surely frees (only the cache reads them, one key of a user not
        pinned names them: a page a running request still reads, or a pinned user's, is never evicted),
        least recently used first; stops once it counted `need` (one or two keys when the pool is full of
        cached pages, not a pass over the index per page taken)."""
        n = 0
        for c in self._index.values():
            if n >= need:
                break
            if c.user not in pinned and self._keys[c.page] == 1 and self.pool.refs(c.page) == 1:
                n += 1
        return n

    def simulate_eviction(self, sim, pinned: set[str]) -> None:
        """Into `sim` (residency.FreeSim): drop every page that only the cache reads once what `sim` dropped
        before is gone, unless a pinned user's key names it (eviction drops the other keys; the page stays)."""
        kept = {c.page for c in self._index.values() if c.user in pinned}
        for page in self._keys:
            if page not in kept and sim.refs(page) == 1 and sim.take(("prefix", page)):
                sim.drop([page])

    def drop_key(self, h: bytes, evicted: bool = True) -> None:
        with self.pool.lock:
            c = self._index.pop(h)
            if evicted:
                self.stats.evicted += 1
            else:
                self.stats.dropped += 1
            self.pool.residency.remove(c.user, [c.page])
            left = self._keys[c.page] - 1
            if left:  # another key still names the page
                self._keys[c.page] = left
            else:
                del self._keys[c.page]
                self.pool.release([c.page])

    # -- the delete cascade ------------------------------------------------------------------------------------
    def drop_user(self, user: str) -> int:
        """Every page of `user` leaves the index (a delete of any of their memories, sessions or adapters: the
        K/V of a page carry every token before it). Pages still read go back once their readers are done."""
        with self.pool.lock:
            self._epochs[user] = self._epochs.get(user, 0) + 1
            keys = [h for h, c in self._index.items() if c.user == user]
            for h in keys:
                self.drop_key(h, evicted=False)
            return len(keys)

    def drop_block(self, item_id: str) -> int:
        """Every page whose prompt began with block item `item_id` leaves the index; a request that resolved the
        block before this puts none back (`insert`)."""
        with self.pool.lock:
            self._block_epochs[item_id] = self._block_epochs.get(item_id, 0) + 1
            keys = [h for h, c in self._index.items() if c.block == item_id]
            for h in keys:
                self.drop_key(h, evicted=False)
            return len(keys)
