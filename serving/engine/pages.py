"""The KV page pool: fixed-size pages of K/V with reference counts, shared by every request that reads them.

One pool per model: `k` and `v` are [layers, pages * page_size, kv_heads, head_dim] tensors allocated once
(`--kv-pool-mb`), addressed by *slot* (page * page_size + offset). A stored block item is copied into pages
once (`SharedPages.acquire`); every request over it holds references to those pages, and the pages of a
knowledge parent are referenced by every child built on it. A request's own tokens go into pages it owns;
when it starts inside a shared page (its prompt leaves the block mid-page) that one page is copied into a
page of its own (copy-on-write), so a shared page is never written after it is filled. The stored items
stay immutable: the pool holds copies, and an item's pages are dropped with it (`SharedPages.drop`).

Accounting is exact: `used_pages` is the number of pages with a reference; `shared_pages` the pages held by
resident items; the rest are requests' private pages. Finished requests' full pages stay as a prefix cache
(`prefix`, prefix_cache.py). When no page is free, unread things are evicted: unreferenced items, then
unread prefix pages, then live sessions' kept tables (`reclaimers`), least recently used first within each
(or by the scheduler's heat, and never a pinned user's: `residency`, residency.py, which also charges each
user the pages kept for them and holds them to a quota), and nothing is evicted when even all of that could
not make enough room. A sequence takes pages as it
crosses into them (table.py); one that finds none preempts the newest sequence (batcher.py), a new request
that finds none waits at admission, then gets 429, and one that could never fit gets 400 (sequence.py):
never an out-of-memory error in a forward. Free pages are kept as runs (free_runs.py) and the counts
`stats` reads are kept as pages come and go, so each operation costs what it touches, not the pool's size
(100k+ pages on a large GPU). Thread-safe (one lock): requests run on the model thread, a delete drops an
item from the event loop.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from serving.engine.copy_times import CopyTimes
from serving.engine.errors import PoolFull
from serving.engine.free_runs import FreeRuns
from serving.engine.prefix_cache import PrefixCache
from serving.engine.residency import Holder, Residency
from serving.engine.waiting import Waiting

DEFAULT_PAGE_TOKENS = 16
CPU_POOL_MB = 1024  # the pool's size on CPU when none is given
DEVICE_POOL_FRACTION = 0.8  # of a GPU's free memory, when no size is given (see pool_bytes_on_device)
__all__ = [
    "CPU_POOL_MB",
    "DEFAULT_PAGE_TOKENS",
    "DEVICE_POOL_FRACTION",
    "PagePool",
    "PoolFull",
    "PoolShape",
    "Reclaimer",
    "SharedPages",
    "pool_bytes_on_device",
]


def pool_bytes_on_device(free_bytes: int, fraction: float, reserved_bytes: int = 0) -> int:
    """The pool's size on a GPU when none is given, as vLLM's `gpu_memory_utilization` sizes its KV cache:
    `fraction` of the device memory free once the model is loaded, less `reserved_bytes` that other things
    will take later (the KV store's device tier), so that the rest (a step's activations, CUDA graphs'
    buffers, adapters) has room. 0 when nothing is left (PagePool then refuses it by name)."""
    if not 0 < fraction <= 1:
        raise ValueError(f"the KV pool's fraction of free device memory must be in (0, 1], got {fraction}")
    return max(0, int((free_bytes - reserved_bytes) * fraction))


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


Reclaimer = Holder  # something that keeps pages it gives back when the pool runs short (sessions.py)


class PagePool:
    """Pages with reference counts over two preallocated tensors (see the module docstring)."""

    # stored blocks copied into pages (`write`): how many, their bytes, and (`copied_seconds`, `copy_sample`)
    # the time they took (copy_times.py): what a load from host RAM costs here (load_costs.py)
    copies = copied_bytes = 0

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
        self.copy_times = CopyTimes(self.k.device)
        self._free = FreeRuns(num_pages)
        self.lock = threading.RLock()
        self.residency = Residency(self)  # who keeps which pages, quotas, pins, what goes first
        self.shared = SharedPages(self)
        self.prefix = PrefixCache(self)
        # holders beyond the items and the prefix cache, asked under the lock while pages are short: each drops
        # something it keeps pages for (a live session's table, serving/engine/sessions.py)
        self.reclaimers: list[Reclaimer] = []
        # the page tables of preempted sequences waiting to be admitted again (serving/engine/batcher.py):
        # while one waits, a new request is not admitted (a preempted sequence goes first; a preempted background
        # row holds back background requests only: table.py)
        self.preempted: set = set()
        # the requests waiting for pages at admission, in arrival order: the oldest is admitted first (waiting.py)
        self.waiting = Waiting(self)
        # bumped, and the listeners called (under the lock: they must not take it), whenever room may have
        # appeared: a page freed, an item's last reader gone, a preempted table admitted again or closed. A
        # request waiting for admission waits for it to change (serving/engine/sequence.py)
        self.generation = 0
        self.listeners: list[Callable[[], None]] = []
        self.graphs = None  # the model's decode graphs (graphs.DecodeGraphs), set by its owner on a GPU
        self.prefill_graphs = None  # lone prefill chunks' graphs (prefill_graphs.PrefillGraphs), likewise

    # -- pages ---------------------------------------------------------------------------------------------
    @property
    def free_pages(self) -> int:
        with self.lock:
            return self._free.count

    @property
    def used_pages(self) -> int:
        with self.lock:
            return self.num_pages - self._free.count

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_tokens)

    def changed(self) -> None:
        """Room may have appeared: bump `generation` and tell the listeners (see __init__)."""
        with self.lock:
            self.generation += 1
            for listener in self.listeners:
                listener()

    def alloc(self, n: int) -> list[int]:
        """n fresh pages, each with one reference, one run when the free pages hold one; unread items are
        evicted and reclaimers asked first when fewer are free. Raises PoolFull."""
        with self.lock:
            self.make_room(n)
            if self._free.count < n:
                raise PoolFull(f"the KV pool has {self._free.count} free pages; {n} needed")
            pages = self._free.take(n)
            for p in pages:
                self._refs[p] = 1
            return pages

    def make_room(self, pages: int) -> bool:
        """Free pages until `pages` are free: unread things by the residency's policy (unread items, prefix
        pages, then sessions' tables, least recently used first). Evicts nothing when even all of that could
        not free enough (a request that waits must not empty the pool of blocks and sessions on every try;
        `Residency.freeable_pages`). Whether `pages` are free."""
        with self.lock:
            if self._free.count >= pages:
                return True
            # the holders' own counts first (cheap); when they say no, the exact count, which also sees what
            # becomes evictable once something else goes (a block read only by an idle session's table)
            if self._free.count + self.residency.reclaimable_pages() < pages:
                if self._free.count + self.residency.freeable_pages() < pages:
                    return False
            while self._free.count < pages and self.residency.evict_one():
                pass
            return self._free.count >= pages

    def ref(self, pages: list[int]) -> None:
        with self.lock:
            for p in pages:
                assert self._refs[p] > 0, f"page {p} is not in use"
                self._refs[p] += 1

    def release(self, pages: list[int]) -> None:
        with self.lock:
            freed = False
            for p in pages:
                assert self._refs[p] > 0, f"page {p} released more often than referenced"
                self._refs[p] -= 1
                if self._refs[p] == 0:
                    self._free.add(p)
                    freed = True
            if freed:
                self.changed()

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
        """kv: [layers, 2, kv_heads, n, head_dim] (a KVItem's layout) into `slots` (n of them). From host
        memory to a GPU the copy is non_blocking (overlapped when the host copy is page-locked); counted in
        `copies`, `copied_bytes`, `copied_seconds`."""
        slots = slots.to(self.k.device)
        begun = self.copy_times.begin()
        kv = kv.to(self.k.device, non_blocking=True)
        self.k[:, slots] = kv[:, 0].transpose(1, 2).to(self.k.dtype)
        self.v[:, slots] = kv[:, 1].transpose(1, 2).to(self.v.dtype)
        nbytes = kv.numel() * kv.element_size()
        ended = self.copy_times.end(begun, nbytes)
        with self.lock:
            self.copies += 1
            self.copied_bytes += nbytes
            self.copy_times.add(ended)

    @property
    def copied_seconds(self) -> float:
        """The seconds the copies into pages took, those still running on a GPU not yet counted."""
        with self.lock:
            self.copy_times.settle()
            return self.copy_times.seconds

    def copy_sample(self) -> tuple[int, float]:
        """(bytes, seconds) of the copies whose time is known: a rate of loads from host memory."""
        with self.lock:
            self.copy_times.settle()
            return self.copy_times.bytes, self.copy_times.seconds

    def read(self, slots: torch.Tensor) -> torch.Tensor:
        """The K/V at `slots` as [layers, 2, kv_heads, n, head_dim] (a copy)."""
        slots = slots.to(self.k.device)
        return torch.stack([self.k[:, slots], self.v[:, slots]], dim=1).transpose(2, 3).contiguous()

    # -- accounting ----------------------------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        """Counts kept as pages come and go: O(1), not a pass over the pages per scrape."""
        with self.lock:
            used = self.num_pages - self._free.count
            shared = self.shared.page_count()
            cached = len(self.prefix)  # the pages the prefix cache holds (read or not), each once
            pb = self.shape.page_bytes
            return {
                "pages_total": self.num_pages,
                "pages_used": used,
                "pages_shared": shared,
                "shared_bytes": shared * pb,
                "prefix_cache_bytes": cached * pb,
                "private_bytes": (used - shared - cached) * pb,
                "page_bytes": pb,
            }


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

    def __init__(self, pool: PagePool) -> None:
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

    def simulate_eviction(self, sim, pinned: set[str]) -> None:
        """Into `sim` (residency.FreeSim): drop every entry of a user not pinned that nobody would read once
        what `sim` dropped before is gone; a child dropped lets go of its parent, which may go then too."""
        gone: set[int] = set()
        more = True
        while more:
            more = False
            for e in self._entries.values():
                if id(e) in gone or e.user in pinned or sim.readers(e) > 0:
                    continue
                gone.add(id(e))
                sim.drop(e.pages)
                if e.parent is not None:
                    sim.unread(e.parent)
                more = True

    def reclaimable_pages(self) -> int:
        return self.unread_pages()

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
