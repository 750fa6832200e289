"""Live sessions' KV caches: a turn of a conversation prefills only what the last turn's cache does not cover.

The prompt layout keeps `[block][client system][history]` an exact token prefix of the next turn's prompt
(kvmem/kv/layout.py), so the cache a turn leaves behind covers most of the next turn. An entry is that cache
and the ids it holds, keyed by (user, session): never looked up across users. A request *takes* its entry
(nobody else can use it while the request runs) and starts from its positions up to the longest common
token prefix with its own prompt (`reuse`); the entry's pages are referenced, never written (nor is a stored
block item it began from). When the turn ends the request *puts* its cache back as the session's entry.

An entry's cache is the sequence's page table (table.py), whose pages a next turn references instead of
copying; it is closed (its pages go back) when its entry is dropped or replaced, and the engine's pool drops
the least recently used entry when it runs short (it is one of the pool's holders, residency.py:
`candidates`, `drop_key`). An entry's pages are charged to its user (but a knowledge item's, charged to
their owner), and a user's quota may drop their oldest entries (residency.py). Closing happens outside
this class's lock; `put` takes the pool's lock before this class's (the pool's eviction takes them in that
order).

Bounded: total bytes and entries per user, least recently used dropped first. Delete cascade: `forget`
(memories of a user) and `drop_block` (a block item) drop every entry whose ids carry them, and mark
requests running with them so their caches are not put back. Thread-safe. Knows nothing of HTTP or tiers.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvmem.kv.inject import common_prefix_tokens
from kvmem.kv.knowledge import KNOWLEDGE_OWNER

if TYPE_CHECKING:
    from serving.engine.table import PageTable


@dataclass(frozen=True)
class SessionEntry:
    user_id: str
    session_id: str
    ids: tuple[int, ...]  # the tokens the cache holds, in order
    cache: PageTable  # the turn's page table: its pages hold `ids`' K/V
    nbytes: int
    block_item_id: str | None  # the block item the prompt began with (its memories are in memory_ids)
    memory_ids: frozenset[str]  # every memory whose text the ids carry (block and retrieved)
    variant: str | None  # what else shaped the K/V (e.g. a LoRA adapter's id): reused only under the same
    charged: tuple[int, ...] = ()  # the pages charged to the user (residency.py)
    tick: int = 0  # when it was put (residency.py's order)


@dataclass
class Lease:
    """One request's hold on its session: the entry it took (or None) and what its own prompt carries."""

    user_id: str
    session_id: str
    block_item_id: str | None
    memory_ids: frozenset[str]
    entry: SessionEntry | None
    number: int
    variant: str | None = None
    stale: bool = field(default=False)  # a delete touched what the request carries: do not put it back


@dataclass
class SessionStats:
    hits: int = 0  # requests that started from their session's cache
    misses: int = 0  # requests with a session but no usable entry
    dropped: int = 0  # entries dropped (LRU, bounds, delete cascade)


def _close(caches: Iterable) -> None:
    """Give back what the caches hold (their pages)."""
    for cache in caches:
        if cache is not None:
            cache.close()


class SessionCache:
    def __init__(self, max_bytes: int, max_per_user: int = 4):
        if max_bytes < 0 or max_per_user < 1:
            raise ValueError(
                f"SessionCache needs max_bytes >= 0 and max_per_user >= 1, got {max_bytes}, {max_per_user}"
            )
        self.max_bytes, self.max_per_user = max_bytes, max_per_user
        self._entries: OrderedDict[tuple[str, str], SessionEntry] = OrderedDict()  # least recent first
        self._bytes = 0
        self._leases: dict[int, Lease] = {}
        self._numbers = itertools.count()
        self._lock = threading.Lock()
        self.stats = SessionStats()

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def peek(self, user_id: str, session_id: str) -> SessionEntry | None:
        """The session's entry, if held (for inspection: a request takes it)."""
        with self._lock:
            return self._entries.get((user_id, session_id))

    def keys(self) -> list[tuple[str, str]]:
        """(user, session) of the entries held, least recently used first."""
        with self._lock:
            return list(self._entries)

    # -- a request's turn ----------------------------------------------------------------------------------
    def take(
        self,
        user_id: str,
        session_id: str,
        block_item_id: str | None,
        memory_ids: Iterable[str],
        variant: str | None = None,
    ) -> Lease:
        """Take the session's entry out (None if there is none) for one request carrying `memory_ids` under
        `variant` (an entry made under another variant is dropped: its K/V are not this request's)."""
        unusable = None
        with self._lock:
            entry = self._entries.pop((user_id, session_id), None)
            if entry is not None:  # the request's now: no longer kept for the user
                self._bytes -= entry.nbytes
                entry.cache.pool.residency.remove(entry.user_id, entry.charged)
                if entry.user_id != user_id or entry.variant != variant:  # never serve K/V made otherwise
                    unusable, entry = entry.cache, None
            lease = Lease(
                user_id, session_id, block_item_id, frozenset(memory_ids), entry, next(self._numbers), variant
            )
            self._leases[lease.number] = lease
        _close([unusable])
        return lease

    def reuse(self, lease: Lease, prompt_ids: Sequence[int], reused: int) -> int:
        """Prompt tokens the request starts with from its session's entry: the common prefix with the prompt
        (at least one token left to prefill) when that covers more than `reused` (a block item's), else 0.
        Counts a hit or a miss."""
        entry, n = lease.entry, 0
        if entry is not None:
            n = min(common_prefix_tokens(entry.ids, prompt_ids), len(prompt_ids) - 1)
            n = n if n > 0 and n >= reused else 0
        with self._lock:
            if n:
                self.stats.hits += 1
            else:
                self.stats.misses += 1
        return n

    def trim(self, lease: Lease, n: int) -> None:
        """The request reads the first `n` tokens of the entry it took (`reuse`): the entry's pages past them
        go back now, all of them when `n` is 0. Held until the turn ended, they were pages the pool had to find
        beside the turn's own, which admission's PoolTooSmall check does not count: a turn that diverged early
        with a long reply preempted itself and could never be admitted again."""
        entry = lease.entry
        if entry is None:
            return
        if n:
            entry.cache.keep(n)  # the lease's alone: `take` took it out of the entries
        else:
            _close([entry.cache])

    def started(self, lease: Lease) -> None:
        """The request was admitted: its own table references the pages of the entry it reuses, so the entry's
        table goes back now (closing it again later is a no-op)."""
        _close([lease.entry.cache if lease.entry is not None else None])

    def put(self, lease: Lease, ids: Sequence[int], cache: PageTable) -> bool:
        """After the turn: keep `cache` (holding `ids`) as the session's entry, unless a delete touched what the
        request carried, or it is over the bounds or the user's quota. Returns whether it was kept. The
        entry the request took goes; a cache not kept is closed."""
        with cache.pool.lock:
            kept = self._put(lease, ids, cache)
            if kept:
                cache.pool.residency.enforce(lease.user_id)
            with self._lock:
                return (lease.user_id, lease.session_id) in self._entries

    def _put(self, lease: Lease, ids: Sequence[int], cache: PageTable) -> bool:
        gone = [lease.entry.cache if lease.entry is not None and lease.entry.cache is not cache else None]
        try:
            with self._lock:
                self._leases.pop(lease.number, None)
                if lease.stale or not self.enabled:
                    gone.append(cache)
                    return False
                nbytes = cache.nbytes
                if cache.get_seq_length() != len(ids) or nbytes > self.max_bytes:
                    gone.append(cache)
                    return False
                key = (lease.user_id, lease.session_id)
                # a concurrent request of the same session put one: newest wins
                old = self._entries.pop(key, None)
                if old is not None:
                    self._bytes -= old.nbytes
                    old.cache.pool.residency.remove(old.user_id, old.charged)
                    gone.append(old.cache)
                item = cache._shared
                skip = cache.item_pages if item is not None and item.user == KNOWLEDGE_OWNER else 0
                residency = cache.pool.residency
                self._entries[key] = SessionEntry(
                    lease.user_id,
                    lease.session_id,
                    tuple(ids),
                    cache,
                    nbytes,
                    lease.block_item_id,
                    lease.memory_ids,
                    lease.variant,
                    tuple(cache.pages[skip:]),
                    residency.tick(),
                )
                residency.add(lease.user_id, cache.pages[skip:])
                self._bytes += nbytes
                gone += self._evict(lease.user_id)
                return key in self._entries
        finally:
            _close(gone)

    def release(self, lease: Lease) -> None:
        """The request ended without a cache to keep (failed, or nothing to store): the entry it took goes."""
        with self._lock:
            self._leases.pop(lease.number, None)
        _close([lease.entry.cache if lease.entry is not None else None])

    # -- bounds and the delete cascade -----------------------------------------------------------------------
    def _evict(self, user_id: str) -> list:
        """Least recently used first: the user's oldest over max_per_user, then anyone's over max_bytes.
        Returns the caches dropped (to close outside the lock)."""
        mine = [k for k in self._entries if k[0] == user_id]
        gone = [self._remove(key) for key in mine[: max(0, len(mine) - self.max_per_user)]]
        while self._bytes > self.max_bytes and self._entries:
            gone.append(self._remove(next(iter(self._entries))))
        return gone

    def _remove(self, key: tuple[str, str]):
        entry = self._entries.pop(key)
        self._bytes -= entry.nbytes
        entry.cache.pool.residency.remove(entry.user_id, entry.charged)
        self.stats.dropped += 1
        return entry.cache

    # -- a holder of the pool's pages (residency.py) ---------------------------------------------------------
    category = 2  # evicted after unread items and prefix pages

    def candidates(self, user: str | None = None, unread: bool = True) -> Iterator[tuple[int, str, object]]:
        """(tick, user, key) of its entries, least recently used first (an entry is read by nobody: a request
        takes it out while it runs)."""
        with self._lock:
            found = [(e.tick, k[0], k) for k, e in self._entries.items() if user is None or k[0] == user]
        yield from found

    def drop_key(self, key) -> None:
        with self._lock:
            cache = self._remove(key) if key in self._entries else None
        _close([cache])

    def surely_freeable(self, need: int, pinned: set[str]) -> int:
        """Up to `need`: pages that dropping its entries of users not pinned surely frees (only the entry's
        table holds them), least recently used first; stops once it counted `need`."""
        with self._lock:
            tables = [e.cache for k, e in self._entries.items() if k[0] not in pinned]
        n = 0
        for table in tables:
            if n >= need:
                break
            n += sum(1 for p in table.pages if table.pool.refs(p) == 1)
        return n

    def simulate_eviction(self, sim, pinned: set[str]) -> None:
        """Into `sim` (residency.FreeSim): drop every entry of a user not pinned (a running request took its
        own out): its table's pages and its reader's hold on the item it began from."""
        with self._lock:
            entries = [(k, e.cache) for k, e in self._entries.items() if k[0] not in pinned]
        for key, table in entries:
            if sim.take(("session", key)):
                sim.drop(table.pages)
                if table._shared is not None:
                    sim.unread(table._shared)

    def reclaimable_bytes(self) -> int:
        """Bytes of pages its entries hold beyond their items' (what dropping them all could free at most)."""
        return self._bytes

    def drop_oldest(self) -> bool:
        """Drop the least recently used entry (the engine's pool is short of pages); False if none is held."""
        with self._lock:
            if not self._entries:
                return False
            cache = self._remove(next(iter(self._entries)))
        _close([cache])
        return True

    def forget(self, user_id: str, memory_ids: Iterable[str] | None = None) -> list[tuple[str, str]]:
        """Drop the user's entries whose ids carry any of `memory_ids` (None: all the user's), and mark the
        user's running requests that carry them. Returns the (user, session) keys dropped."""
        wanted = None if memory_ids is None else frozenset(memory_ids)

        def hit(user: str, carried: frozenset[str]) -> bool:
            return user == user_id and (wanted is None or not wanted.isdisjoint(carried))

        return self._drop_where(lambda user, _block, carried: hit(user, carried))

    def drop_block(self, item_id: str) -> list[tuple[str, str]]:
        """Drop the entries (and mark the running requests) that began with block item `item_id`."""
        return self._drop_where(lambda _user, block, _carried: block == item_id)

    def drop_user(self, user_id: str) -> list[tuple[str, str]]:
        return self.forget(user_id, None)

    def _drop_where(self, match) -> list[tuple[str, str]]:
        with self._lock:
            for lease in self._leases.values():
                if match(lease.user_id, lease.block_item_id, lease.memory_ids):
                    lease.stale = True
            keys = [k for k, e in self._entries.items() if match(e.user_id, e.block_item_id, e.memory_ids)]
            gone = [self._remove(key) for key in keys]
        _close(gone)
        return keys
