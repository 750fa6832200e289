"""What stays in the page pool: per-user accounting of cached pages, per-user quotas, pins, and which unread
thing goes first when the pool is short.

Three kinds of holders keep pages beyond the requests that run (each a `Holder`): resident items
(shared_pages.py, category 0), cached prefix pages (prefix_cache.py, category 1) and live sessions'
kept tables (sessions.py, category 2). Each charges the pages it keeps to a user (`add`, `remove`); a user's
charge is the number of *distinct* pages their holders keep (a session table and the prefix cache that both
keep a page count it once), exact at every point under the pool's lock. A knowledge item's pages are charged
to its owner (KNOWLEDGE_OWNER), which has no quota.

- Quota (`quota_pages`, `--kv-user-mb`): after anything is charged to a user, the user's own least recently
  used things are dropped until the charge is within it (`enforce`), read or unread (a thing still read just
  leaves its holder: its readers keep their own references, so a running request never loses a page). So
  one user's cached K/V never pushes past its share: what other users keep stays.
- Eviction when the pool is short (`evict_one`): unread things only (their pages come back), never a pinned
  user's. Policy "lru": the holders in category order (unread items, then prefix pages, then sessions), least
  recently used first within one. Policy "heat": the coldest user's first (`heat(user)`: the scheduler's
  expected reuse of the user's memories, higher keeps longer), ties by category then age.
- Pins (`pin`): a prewarmed user's things are not evicted for room (within the quota, which still holds).

A user's heat is asked once, the first time an eviction ranks them (under the pool's lock); after that a
daemon thread (`refresh_heat`, every HEAT_TTL_S) asks it again for every user holding pages, outside any
lock, so an eviction on the model thread reads a cached number and never waits on the scheduler's table.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Protocol

from kvmem.kv.knowledge import KNOWLEDGE_OWNER

log = logging.getLogger(__name__)

POLICIES = ("lru", "heat")
HEAT_TTL_S = 5.0  # how often the refresher asks users' heat again (it may read the scheduler's table)


class Holder(Protocol):
    """Something that keeps pool pages for users (an item's entry, a prefix page, a session's table)."""

    category: int  # eviction order under "lru": lower goes first

    def candidates(self, user: str | None = None, unread: bool = True) -> Iterator[tuple[int, str, object]]:
        """(tick of its last use, user, key) of what it keeps, least recently used first: those nobody else
        reads (`unread`: dropping them frees pages), or with `unread=False` all of `user`'s."""

    def drop_key(self, key: object) -> None:
        """Drop one thing it keeps (its pages go back once nobody reads them)."""

    def surely_freeable(self, need: int, pinned: set[str]) -> int:
        """Up to `need`: pages that evicting what it keeps for users not in `pinned` surely frees (a lower
        bound, cheap: it stops once it counted `need`)."""

    def simulate_eviction(self, sim: FreeSim, pinned: set[str]) -> None:
        """Drop into `sim` (each thing once: `sim.take`) what it would let go of for room, given what `sim`
        dropped so far; asked again until nothing more goes (what one drops may let another's go)."""


class Residency:
    def __init__(self, pool) -> None:  # pages.PagePool, which makes it
        self.pool = pool
        self.quota_pages: int | None = None  # per user; None: no quota
        self.policy = "lru"
        self._heat: Callable[[str], float] | None = None  # a user's expected reuse (policy "heat")
        self._refresher: threading.Thread | None = None
        self._refresh_wait = threading.Event()  # never set: the refresher's sleep
        self.pinned: set[str] = set()
        self._held: dict[str, Counter] = {}  # user -> page -> how many of the user's holders keep it
        self._lock = threading.Lock()  # a leaf: the counts only (a holder may charge under its own lock)
        self._tick = 0
        self.peak: dict[str, int] = {}  # each user's highest charge seen after a change settled (enforce)
        self._heat_seen: dict[str, float] = {}  # user -> heat, as last asked

    @property
    def heat(self) -> Callable[[str], float] | None:
        return self._heat

    @heat.setter
    def heat(self, heat: Callable[[str], float] | None) -> None:
        """Set the users' heat; the first one set starts the refresher (it stops with this Residency)."""
        self._heat = heat
        if heat is not None and self._refresher is None:
            self._refresher = threading.Thread(
                target=_refresh_loop, args=(weakref.ref(self),), name="kv-heat", daemon=True
            )
            self._refresher.start()

    def configure(
        self, quota_bytes: int | None = None, policy: str = "lru", heat: Callable[[str], float] | None = None
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown KV eviction policy {policy!r}: one of {', '.join(POLICIES)}")
        if quota_bytes is not None:
            if quota_bytes < self.pool.shape.page_bytes:
                raise ValueError(
                    f"a per-user KV quota of {quota_bytes} bytes holds no page of {self.pool.shape.page_bytes} "
                    "bytes: raise --kv-user-mb"
                )
            self.quota_pages = quota_bytes // self.pool.shape.page_bytes
        self.policy, self.heat = policy, heat

    def tick(self) -> int:
        with self._lock:
            self._tick += 1
            return self._tick

    # -- accounting ----------------------------------------------------------------------------------------
    def add(self, user: str, pages) -> None:
        with self._lock:
            held = self._held.setdefault(user, Counter())
            for p in pages:
                held[p] += 1

    def remove(self, user: str, pages) -> None:
        with self._lock:
            held = self._held.get(user)
            for p in pages:
                assert held is not None and held[p] > 0, f"page {p} uncharged from {user!r} more than charged"
                held[p] -= 1
                if held[p] == 0:
                    del held[p]
            if held is not None and not held:
                del self._held[user]

    def pages_of(self, user: str) -> int:
        """Distinct pages the user's holders keep."""
        with self._lock:
            return len(self._held.get(user, ()))

    def usage(self) -> dict[str, int]:
        """Each user's charge in pages (under the pool's lock: a settled point)."""
        with self.pool.lock, self._lock:
            return {u: len(h) for u, h in self._held.items()}

    # -- quotas and pins -----------------------------------------------------------------------------------
    def pin(self, user: str) -> None:
        with self.pool.lock:
            self.pinned.add(user)

    def unpin(self, user: str) -> None:
        with self.pool.lock:
            self.pinned.discard(user)

    def enforce(self, user: str) -> None:
        """Drop the user's least recently used things until their charge is within the quota."""
        with self.pool.lock:
            if self.quota_pages is not None and user != KNOWLEDGE_OWNER:
                while self.pages_of(user) > self.quota_pages:
                    oldest = min(
                        (
                            (tick, i, key)
                            for i, h in enumerate(self.holders())
                            for tick, _, key in _first(h.candidates(user, unread=False))
                        ),
                        default=None,
                        key=lambda c: c[:2],
                    )
                    if oldest is None:
                        break
                    self.holders()[oldest[1]].drop_key(oldest[2])
            n = self.pages_of(user)
            if n > self.peak.get(user, 0):
                self.peak[user] = n

    # -- eviction for room ---------------------------------------------------------------------------------
    def holders(self) -> list[Holder]:
        return sorted([self.pool.shared, self.pool.prefix, *self.pool.reclaimers], key=lambda h: h.category)

    def surely_freeable(self, need: int) -> int:
        """Up to `need`: pages that evicting for room surely frees (a lower bound that stops once it counted
        `need`: when the pool is full of cached pages, the first unread one or two)."""
        with self.pool.lock:
            n = 0
            for holder in self.holders():
                if n >= need:
                    break
                n += holder.surely_freeable(need - n, self.pinned)
            return n

    def freeable_pages(self) -> int:
        """Exactly how many pages evicting for room (`evict_one`, again and again) could free: live sessions'
        tables (a running request took its own out), which lets go of the items and prefix pages only they
        read, those items (and the knowledge parents only their children read), the prefix pages only the cache
        reads, until nothing more would go; never a pinned user's. Passes over what the holders keep, taken
        only when `surely_freeable` falls short (pages.py `make_room`)."""
        with self.pool.lock:
            sim = FreeSim(self.pool)
            holders = sorted(self.holders(), key=lambda h: -h.category)  # the readers of the rest first
            while True:
                taken = sim.taken
                for holder in holders:
                    holder.simulate_eviction(sim, self.pinned)
                if sim.taken == taken:
                    return sim.freed()

    def evict_one(self) -> bool:
        """Drop one unread thing by the policy (see the module docstring); False if none may go."""
        with self.pool.lock:
            holders = self.holders()
            pick = None
            if self.policy == "heat" and self.heat is not None:
                for i, h in enumerate(holders):
                    for tick, user, key in h.candidates():
                        if user in self.pinned:
                            continue
                        rank = (self._heat_of(user), h.category, tick)
                        if pick is None or rank < pick[0]:
                            pick = (rank, i, key)
            else:
                for i, h in enumerate(holders):
                    first = next((c for c in h.candidates() if c[1] not in self.pinned), None)
                    if first is not None:
                        pick = ((h.category, first[0]), i, first[2])
                        break
            if pick is None:
                return False
            holders[pick[1]].drop_key(pick[2])
            return True

    def _heat_of(self, user: str) -> float:
        """The user's heat as last asked; asked now (under the pool's lock) only the first time."""
        seen = self._heat_seen.get(user)
        if seen is None:
            seen = self._heat_seen[user] = float(self.heat(user))
        return seen

    def refresh_heat(self) -> None:
        """Ask `heat` again for every user holding pages, outside any lock; forget those holding none."""
        heat = self.heat
        if heat is None:
            return
        with self._lock:
            users = list(self._held)
        fresh = {u: float(heat(u)) for u in users}
        with self._lock:
            self._heat_seen = fresh


class FreeSim:
    """What the pool's references and items' readers would be after the drops made into it (nothing changes in
    the pool): `freeable_pages`'s scratch, kept for the pages and entries touched only."""

    def __init__(self, pool) -> None:
        self.pool = pool
        self._refs: dict[int, int] = {}
        self._unread: Counter = Counter()  # entry id -> readers gone
        self._taken: set = set()  # what was dropped (each once)
        self.taken = 0

    def take(self, key) -> bool:
        """Whether `key` (a holder's thing) is dropped now for the first time."""
        if key in self._taken:
            return False
        self._taken.add(key)
        self.taken += 1
        return True

    def refs(self, page: int) -> int:
        got = self._refs.get(page)
        return self.pool.refs(page) if got is None else got

    def drop(self, pages) -> None:
        for p in pages:
            self._refs[p] = self.refs(p) - 1

    def unread(self, entry) -> None:
        self._unread[id(entry)] += 1

    def readers(self, entry) -> int:
        return entry.users - self._unread[id(entry)]

    def freed(self) -> int:
        return sum(1 for r in self._refs.values() if r == 0)


def _refresh_loop(ref: weakref.ref) -> None:
    """The refresher: `refresh_heat` every HEAT_TTL_S while its Residency lives and has a heat."""
    while True:
        residency = ref()
        if residency is None or residency.heat is None:
            return
        try:
            residency.refresh_heat()
        except Exception as exc:  # noqa: BLE001 - a failed read keeps the last numbers; the next round asks again
            log.warning(
                "KV eviction: asking users' heat failed (%s: %s); the last numbers stay",
                type(exc).__name__,
                exc,
            )
        wait = residency._refresh_wait
        del residency
        if wait.wait(HEAT_TTL_S):
            return


def _first(it: Iterator) -> list:
    """The first item of `it`, as a list of none or one."""
    for x in it:
        return [x]
    return []
