"""One sequence's page table: the pages that hold its K/V, shared ones first, then its own.

A sequence over a stored block starts with references to the block's pages for the positions it reuses
(full pages only); when it reuses part of a page, that page is copied into one of its own (copy-on-write),
since its next token goes into that page. A sequence of a live session starts the same way from the table
its session's last turn left (`source`): that table's pages are referenced, never written again, so a
session's history is not copied in nor out. Its own pages are allocated as it crosses into them: its
prompt's at admission (one run of pages when the pool has one), then one page each time its reply crosses
into a new one (`extend`, `grow`); nothing is promised for the reply up front, so a pool runs as many
sequences as their tokens so far fit, and a sequence that finds no page is preempted (`preempt`: its own
pages go back, the shared ones and its copy-on-write page stay) and admitted again later (`readmit`), as
the batcher decides (serving/engine/batcher.py). When a turn ends its table can be `keep`-trimmed and kept
by the session (serving/engine/sessions.py): it then holds its pages until the session drops it. `close`
returns every reference; it may be called more than once.

Prefix reuse (prefix_cache.py): at admission a sequence given its prompt's chained page keys starts, past its
item's full pages, from the cached pages the keys find (full pages, referenced; when they cover the whole
prompt the last one is copied, one token left to prefill), when they cover more than the item; when it ends
its full pages go into the cache (`cache_prefix`).
"""

from __future__ import annotations

import torch

from serving.engine.pages import PagePool, PoolFull
from serving.engine.prefix_cache import PrefixKey, page_hashes


class PageTable:
    def __init__(self, pool: PagePool) -> None:
        self.pool = pool
        self.pages: list[int] = []
        self.length = 0  # positions written
        self.reused = 0  # leading positions taken from an item or a session's table (kept when preempted)
        self.shared_pages = 0  # leading pages referenced from an item or a session's table (never written)
        self.item_pages = 0  # of those, the leading pages that are the item's own entry's
        self.cached_pages = 0  # of those, the pages found in the prefix cache (after the item's)
        self.prefix_key: tuple[int, ...] = ()  # the shared pages: rows with the same read them once (runner)
        self._shared = (
            None  # the shared item entry it holds a reader's reference on (shared_pages.SharedRead.entry)
        )
        self.background = False  # a background row's (batcher.py): a new chat request does not wait for it
        self.from_session = False  # it started from a live session's table (`_start_from_table`)
        self._closed = False

    # -- admission -----------------------------------------------------------------------------------------
    @staticmethod
    def admit(
        pool: PagePool,
        prompt_tokens: int,
        item=None,
        reuse: int = 0,
        source: PageTable | None = None,
        hashes: list[bytes] | None = None,
        background: bool = False,
        ticket=None,
    ) -> PageTable:
        """A table for a sequence whose first `reuse` of `prompt_tokens` positions come from `item`'s pages,
        or from `source`'s (a live session's table; it takes precedence), 0: none, with its own pages for the
        rest of the prompt allocated now (its reply's come as it crosses into them: `extend`). Without a
        source, `hashes` (the prompt's full pages' chained keys) find cached pages past the item's; its
        `reused` then says how many positions it starts with. Raises PoolFull when the pool cannot give them
        now, while a preempted sequence waits to be admitted again (it goes first), or while a request that
        waited longer for pages still waits (`ticket`: this request's place among them, waiting.py). A
        `background` row's table waits for every preempted sequence and waiting request; a chat request's
        for chat ones only."""
        with pool.lock:
            try:
                table = PageTable._admit(pool, prompt_tokens, item, reuse, source, hashes, background, ticket)
                table.background = background
                return table
            except PoolFull as full:
                # after its own releases (a held item let go is a change): what a waiting request waits on
                full.generation = pool.generation
                raise

    @staticmethod
    def _admit(
        pool: PagePool,
        prompt_tokens: int,
        item,
        reuse: int,
        source: PageTable | None,
        hashes,
        background: bool,
        ticket,
    ) -> PageTable:
        table = PageTable(pool)
        pt = pool.page_tokens
        if source is not None:
            item = None
            assert reuse <= source.length, "a session's table reused past its length"
        if item is None and source is None:
            reuse = 0
        preempted = sum(1 for t in pool.preempted if background or not t.background)
        if preempted:
            raise PoolFull(
                f"the KV pool has {pool.free_pages} free pages of {pt} tokens; "
                f"{preempted} preempted sequences wait for pages first"
            )
        ahead = pool.waiting.ahead(ticket, background)
        if ahead:
            raise PoolFull(
                f"the KV pool has {pool.free_pages} free pages of {pt} tokens; "
                f"{ahead} requests that came first wait for pages first"
            )
        hits: list[int] = []  # cached pages after the item's full ones, referenced while room is made
        first = 0  # the item's full pages the prompt starts with
        if source is None and hashes:
            first = reuse // pt if item is not None else 0
            hits = pool.prefix.lookup(hashes, first)
            covered = min((first + len(hits)) * pt, prompt_tokens - 1)
            if hits and covered > reuse:
                pool.ref(hits)
                reuse = covered
            else:
                hits = []
            if hits and not first:
                item = None  # the item's pages are not read: the cache's start at position 0
        need = pool.pages_for(prompt_tokens) - reuse // pt
        # residency and room are one decision, under the pool's lock: a resident item is held (a reader)
        # before unread items may be evicted to make room, so it cannot be the one evicted
        with pool.lock:
            if item is not None and reuse:
                table._shared = pool.shared.resident(item.item_id)
                if table._shared is not None:
                    pool.shared.hold(table._shared)
                else:
                    need += pool.shared.copy_in_pages(item)  # the item is copied in first (not a parent's)
            try:
                if not pool.make_room(need):
                    free = pool.free_pages
                    table.close()  # lets go of the held item
                    raise PoolFull(
                        f"the KV pool has {free} free pages of {pt} tokens; this request needs {need}"
                    )
                try:
                    table.reused = reuse
                    if source is not None and reuse:
                        table._start_from_table(source, reuse, prompt_tokens)
                    elif item is not None and reuse:
                        table._start_from_item(item, reuse, prompt_tokens, hits, first)
                    elif hits:
                        table._start_from_pages(hits, reuse, prompt_tokens)
                        table.cached_pages = table.shared_pages
                    table._grow(prompt_tokens)  # the prompt's own pages now, in one run when the pool has one
                except BaseException:
                    table.close()
                    raise
            finally:
                pool.release(hits)  # the table holds its own references to them now
            if table._shared is not None:  # an item copied in is charged to its owner: within their quota
                pool.residency.enforce(table._shared.user)
        return table

    def _start_from_item(self, item, reuse: int, total: int, hits=(), first: int = 0) -> None:
        pool = self.pool
        with pool.lock:
            if self._shared is not None:  # resident at admission, and held since
                pages = self._shared.pages
            else:  # copied in now (its pages were counted in the room made at admission)
                pages, _, self._shared = pool.shared.acquire(item)
            if hits:  # the item's first `first` pages, then the cached ones
                self._start_from_pages([*pages[:first], *hits], reuse, total)
                self.item_pages, self.cached_pages = first, self.shared_pages - first
            else:
                self._start_from_pages(pages, reuse, total)
                self.item_pages = self.shared_pages

    def _start_from_table(self, source: PageTable, reuse: int, total: int) -> None:
        """Reference the full pages of `source` (a session's table) that the first `reuse` positions fill, as
        an item's; the item entry it began with gets one more reader, so it stays resident meanwhile."""
        pool = self.pool
        with pool.lock:
            if source._shared is not None and pool.shared.hold(source._shared):
                self._shared = source._shared
            self._start_from_pages(source.pages, reuse, total)
            self.item_pages = min(source.item_pages, self.shared_pages) if self._shared is not None else 0
            self.from_session = True

    def _start_from_pages(self, pages: list[int], reuse: int, total: int) -> None:
        """Reference the full pages of `pages` that the first `reuse` positions fill; copy the partly reused
        page into an own page (copy-on-write: the next token goes into it)."""
        pool, pt = self.pool, self.pool.page_tokens
        full = reuse // pt
        self.pages = list(pages[:full])
        pool.ref(self.pages)
        self.shared_pages = full
        self.prefix_key = tuple(self.pages)
        self.length = full * pt
        if reuse > self.length:
            self._grow(max(reuse, total))  # its own pages in one run, the copied page first
            src = pool.slots(pages, self.length, reuse)
            dst = pool.slots(self.pages, self.length, reuse)
            pool.k[:, dst.to(pool.k.device)] = pool.k[:, src.to(pool.k.device)]
            pool.v[:, dst.to(pool.v.device)] = pool.v[:, src.to(pool.v.device)]
            self.length = reuse

    # -- steps ---------------------------------------------------------------------------------------------
    def _grow(self, end: int) -> None:
        """Own pages until positions [0, end) have a page (one run when the pool has one). Raises PoolFull."""
        missing = self.pool.pages_for(end) - len(self.pages)
        if missing > 0:
            self.pages += self.pool.alloc(missing)

    def grow(self, end: int) -> bool:
        """Pages for positions [0, end), evicting unread items and live sessions when the pool is short;
        False (nothing taken) when they are not there even then."""
        try:
            self._grow(end)
        except PoolFull:
            return False
        return True

    def own_pages(self) -> int:
        """Pages a preemption would give back: past the shared ones and the copy-on-write page."""
        return max(0, len(self.pages) - self.pool.pages_for(self.reused))

    def preempt(self) -> None:
        """Give back its own pages but the copy-on-write one (recompute: the sequence prefills its tokens
        after `reused` again once `readmit`ted); the shared pages and the item it reads stay held, so nothing
        it reuses is evicted or dropped from under it. The table waits in `pool.preempted` until then."""
        with self.pool.lock:
            keep = self.pool.pages_for(self.reused)
            extra, self.pages = self.pages[keep:], self.pages[:keep]
            self.length = self.reused
            self.pool.preempted.add(self)
            self.pool.release(extra)

    def readmit(self, end: int) -> bool:
        """A preempted table gets pages for positions [0, end) again (one run when the pool has one); False
        (nothing taken) when they are not there."""
        with self.pool.lock:
            if not self.grow(end):
                return False
            self.pool.preempted.discard(self)
            self.pool.changed()
            return True

    def extend(self, n: int, device: torch.device) -> torch.Tensor:
        """Room for n more positions; their slots (the forward writes them). `length` moves on by n."""
        self._grow(self.length + n)
        slots = self.pool.slots(self.pages, self.length, self.length + n, device)
        self.length += n
        return slots

    def read(self, end: int | None = None, start: int = 0) -> torch.Tensor:
        """Positions [start, end) as [layers, 2, kv_heads, n, head_dim] (a copy), e.g. for a session's cache."""
        end = self.length if end is None else end
        return self.pool.read(self.pool.slots(self.pages, start, end))

    # -- a session's entry ---------------------------------------------------------------------------------
    def keep(self, n: int) -> PageTable:
        """Trim to positions [0, n) for a session to keep: the pages past them go back to the pool. Returns
        itself; it is not written again (a next turn references its pages)."""
        assert n <= self.length
        with self.pool.lock:
            keep = self.pool.pages_for(n)
            extra, self.pages = self.pages[keep:], self.pages[:keep]
            self.pool.release(extra)
            self.length = n
            if self in self.pool.preempted:  # a preempted turn that ended (cancelled): nothing waits for it
                self.pool.preempted.discard(self)
                self.pool.changed()
        return self

    def cache_prefix(self, key: PrefixKey, ids) -> int:
        """Its full pages past its item's go into the pool's prefix cache under `key`; `ids`: the tokens its
        positions hold (what was fed). Returns how many pages went in."""
        assert len(ids) == self.length, "the tokens of every position written"
        hashes = page_hashes(key, ids, self.pool.page_tokens)
        return self.pool.prefix.insert(key, hashes, self.pages, self.item_pages)

    def get_seq_length(self) -> int:
        return self.length

    @property
    def nbytes(self) -> int:
        """Bytes of the pages it holds beyond its item's (those are the resident item's, counted there)."""
        return (len(self.pages) - self.item_pages) * self.pool.shape.page_bytes

    # -- end -----------------------------------------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self.pool.lock:
            self.pool.release(self.pages)
            self.pages = []
            if self in self.pool.preempted:
                self.pool.preempted.discard(self)
                self.pool.changed()  # a new request need not wait for it any more
            if self._shared is not None:
                self.pool.shared.release(self._shared)  # exactly the entry it took
                self._shared = None
