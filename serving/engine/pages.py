"""The KV page pool: fixed-size pages of K/V with reference counts, shared by every request that reads them.

One pool per model: `k` and `v` are [layers, pages * page_size, kv_heads, head_dim] tensors allocated once
(`--kv-pool-mb`), addressed by *slot* (page * page_size + offset). A stored block item is copied into pages
once (`SharedPages.acquire`); every request over it holds references to those pages, and the pages of a
knowledge parent are referenced by every child built on it. A request's own tokens go into pages it owns;
when it starts inside a shared page (its prompt leaves the block mid-page) that one page is copied into a
page of its own (copy-on-write), so a shared page is never written after it is filled. The stored items
stay immutable: the pool holds copies, and an item's pages are dropped with it (`SharedPages.drop`).

Accounting is exact: `used_pages` is the number of pages with a reference; `shared_pages` the pages held by
resident items; the rest are requests' private pages. When no page is free, unreferenced items are evicted
(least recently used first), then live sessions' kept tables (`reclaimers`, least recently used first); a
request that still finds none waits at admission, then gets 429 (see
`serving/engine/sequence.py`), never an out-of-memory error in a forward. Thread-safe (one lock): requests run
on the model thread, a delete drops an item from the event loop.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from serving.engine.errors import PoolFull

DEFAULT_PAGE_TOKENS = 16
__all__ = ["DEFAULT_PAGE_TOKENS", "PagePool", "PoolFull", "PoolShape", "SharedPages"]


@dataclass(frozen=True)
class PoolShape:
    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    page_tokens: int = DEFAULT_PAGE_TOKENS

    @property
    def page_bytes(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.layers * self.page_tokens * self.kv_heads * self.head_dim * elem

    @classmethod
    def of_model(cls, model: torch.nn.Module, page_tokens: int = DEFAULT_PAGE_TOKENS) -> PoolShape:
        config = model.config.get_text_config()
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        dtype = next(model.parameters()).dtype
        return cls(config.num_hidden_layers, kv_heads, head_dim, dtype, page_tokens)


class PagePool:
    """Pages with reference counts over two preallocated tensors (see the module docstring)."""

    def __init__(self, shape: PoolShape, pool_bytes: int, device: torch.device | str = "cpu") -> None:
        if shape.page_tokens < 1:
            raise ValueError(f"page_tokens must be >= 1, got {shape.page_tokens}")
        num_pages = pool_bytes // shape.page_bytes
        if num_pages < 1:
            raise ValueError(
                f"a KV pool of {pool_bytes} bytes holds no page of {shape.page_bytes} bytes "
                f"({shape.page_tokens} tokens): raise --kv-pool-mb"
            )
        self.shape, self.num_pages, self.page_tokens = shape, num_pages, shape.page_tokens
        slots = num_pages * shape.page_tokens
        # one slot past the last page, in no page: where a decode graph's pad rows write (graphs.py)
        self.scratch_slot = slots
        size = (shape.layers, slots + 1, shape.kv_heads, shape.head_dim)
        self.k = torch.empty(size, dtype=shape.dtype, device=device)
        self.v = torch.empty(size, dtype=shape.dtype, device=device)
        self.k[:, slots].zero_()  # the scratch slot is read under a -inf mask: never NaN (NaN x 0 is NaN)
        self.v[:, slots].zero_()
        self._refs = [0] * num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # a stack: low pages first
        self._reserved = 0  # pages promised to admitted requests, not yet allocated
        self.lock = threading.RLock()
        self.shared = SharedPages(self)
        # called under the lock while pages are short, after unread items went: each drops something it
        # holds pages for (a live session's table, serving/engine/sessions.py) and says whether it did
        self.reclaimers: list[Callable[[], bool]] = []
        self.graphs = None  # the model's decode graphs (graphs.DecodeGraphs), set by its owner on a GPU

    # -- pages ---------------------------------------------------------------------------------------------
    @property
    def free_pages(self) -> int:
        with self.lock:
            return len(self._free) - self._reserved

    @property
    def used_pages(self) -> int:
        with self.lock:
            return self.num_pages - len(self._free)

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_tokens)

    def reserve(self, pages: int) -> bool:
        """Promise `pages` to a request (allocated later by `alloc(..., reserved=True)`); False if they are not
        there even after evicting unreferenced items."""
        with self.lock:
            self._make_room(pages)
            if self.free_pages < pages:
                return False
            self._reserved += pages
            return True

    def unreserve(self, pages: int) -> None:
        with self.lock:
            assert 0 <= pages <= self._reserved
            self._reserved -= pages

    def alloc(self, n: int, *, reserved: bool = False) -> list[int]:
        """n fresh pages, each with one reference. `reserved`: taken from the caller's reservation."""
        with self.lock:
            if reserved:
                assert n <= self._reserved, "a request allocated more pages than it reserved"
                self._reserved -= n
            else:
                self._make_room(n)
            if len(self._free) - (0 if reserved else self._reserved) < n:
                raise PoolFull(f"the KV pool has {self.free_pages} free pages; {n} needed")
            pages = self._take(n)
            for p in pages:
                self._refs[p] = 1
            return pages

    def _make_room(self, pages: int) -> None:
        """Free pages until `pages` are free: unread items first, then what the reclaimers hold."""
        while self.free_pages < pages:
            self.shared.evict(pages - self.free_pages)
            if self.free_pages >= pages or not any(r() for r in self.reclaimers):  # one drop per round
                return

    def _take(self, n: int) -> list[int]:
        """n free pages, consecutive when the free pages hold such a run (the lowest one): a sequence's or an
        item's pages in one run are read as a view of the pool, without a gather (runner.py)."""
        if n > 1:
            free = sorted(self._free)
            for i in range(len(free) - n + 1):
                if free[i + n - 1] - free[i] == n - 1:
                    run = free[i : i + n]
                    taken = set(run)
                    self._free = [p for p in self._free if p not in taken]
                    return run
        return [self._free.pop() for _ in range(n)]

    def ref(self, pages: list[int]) -> None:
        with self.lock:
            for p in pages:
                assert self._refs[p] > 0, f"page {p} is not in use"
                self._refs[p] += 1

    def release(self, pages: list[int]) -> None:
        with self.lock:
            for p in pages:
                assert self._refs[p] > 0, f"page {p} released more often than referenced"
                self._refs[p] -= 1
                if self._refs[p] == 0:
                    self._free.append(p)

    def refs(self, page: int) -> int:
        with self.lock:
            return self._refs[page]

    def slots(
        self, pages: list[int], start: int, end: int, device: torch.device | None = None
    ) -> torch.Tensor:
        """The slot of each position in [start, end) of a sequence whose positions live in `pages`."""
        pos = torch.arange(start, end)
        table = torch.tensor(pages, dtype=torch.long)
        out = table[pos // self.page_tokens] * self.page_tokens + pos % self.page_tokens
        return out if device is None else out.to(device)

    def write(self, slots: torch.Tensor, kv: torch.Tensor) -> None:
        """kv: [layers, 2, kv_heads, n, head_dim] (a KVItem's layout) into `slots` (n of them)."""
        slots = slots.to(self.k.device)
        self.k[:, slots] = kv[:, 0].transpose(1, 2).to(self.k.dtype)
        self.v[:, slots] = kv[:, 1].transpose(1, 2).to(self.v.dtype)

    def read(self, slots: torch.Tensor) -> torch.Tensor:
        """The K/V at `slots` as [layers, 2, kv_heads, n, head_dim] (a copy)."""
        slots = slots.to(self.k.device)
        return torch.stack([self.k[:, slots], self.v[:, slots]], dim=1).transpose(2, 3).contiguous()

    # -- accounting ----------------------------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        with self.lock:
            used = self.num_pages - len(self._free)
            shared = self.shared.page_count()
            pb = self.shape.page_bytes
            return {
                "pages_total": self.num_pages,
                "pages_used": used,
                "pages_shared": shared,
                "shared_bytes": shared * pb,
                "private_bytes": (used - shared) * pb,
                "page_bytes": pb,
            }


@dataclass
class _Entry:
    pages: list[int]  # the pool's reference to each (the entry's own), covering tokens [0, tokens)
    tokens: int
    item_id: str = ""
    users: int = 0  # readers now: sequences, session tables, resident children
    parent: _Entry | None = None  # the knowledge parent whose full pages it references


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
    parent page on). Entries nobody reads stay until their pages are needed (LRU) or their item is dropped."""

    def __init__(self, pool: PagePool) -> None:
        self.pool = pool
        self._entries: OrderedDict[str, _Entry] = OrderedDict()

    def page_count(self) -> int:
        """Distinct pages held by resident items."""
        with self.pool.lock:
            return len({p for e in self._entries.values() for p in e.pages})

    def __contains__(self, item_id: str) -> bool:
        with self.pool.lock:
            return item_id in self._entries

    def resident(self, item_id: str) -> _Entry | None:
        """The item's resident entry, or None (`hold` it to keep it resident)."""
        with self.pool.lock:
            return self._entries.get(item_id)

    def acquire(self, item) -> SharedRead:
        """The pages of `item` and its tokens, one more reader; copies it into pages if it is not resident.
        `release(read.entry)` when done. Raises PoolFull if there is no room."""
        with self.pool.lock:
            entry = self._entry(item)
            entry.users += 1
            self._entries.move_to_end(item.item_id)
            return SharedRead(entry.pages, entry.tokens, entry)

    def hold(self, entry: _Entry) -> bool:
        """One more reader of `entry` (a session's next turn over its pages) while it is still the resident
        entry of its item; False once it was dropped (even if its item is resident again, as a new entry)."""
        with self.pool.lock:
            if self._entries.get(entry.item_id) is not entry:
                return False
            entry.users += 1
            self._entries.move_to_end(entry.item_id)
            return True

    def release(self, entry: _Entry) -> None:
        """One reader of `entry` is done: exactly the entry it took, resident or dropped since."""
        with self.pool.lock:
            entry.users -= 1
            assert entry.users >= 0, f"item {entry.item_id} released more often than read"

    def drop(self, item_id: str) -> bool:
        """The item is gone (deleted, evicted from the store): its pages go once its readers are done."""
        with self.pool.lock:
            entry = self._entries.pop(item_id, None)
            if entry is None:
                return False
            self.pool.release(entry.pages)
            if entry.parent is not None:
                self.release(entry.parent)
                entry.parent = None
            return True

    def evict(self, pages_wanted: int) -> None:
        """Drop unread entries, least recently used first, until `pages_wanted` pages are free or none is left."""
        with self.pool.lock:
            for item_id in list(self._entries):
                if pages_wanted <= 0:
                    break
                entry = self._entries.get(item_id)
                if entry is None or entry.users > 0 or self._is_parent(item_id):
                    continue
                before = len(self.pool._free)
                self.drop(item_id)
                pages_wanted -= len(self.pool._free) - before

    def _is_parent(self, item_id: str) -> bool:
        entry = self._entries.get(item_id)
        return any(e.parent is entry for e in self._entries.values())

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
                parent.users += 1  # the child reads the parent's pages as long as it is resident
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
        self._entries[item.item_id] = entry
        return entry
