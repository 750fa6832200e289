"""The KV page pool: fixed-size pages of K/V with reference counts, shared by every request that reads them.

One pool per model: `k` and `v` are [layers, pages * page_size, kv_heads, head_dim] tensors allocated once
(`--kv-pool-mb`), addressed by *slot* (page * page_size + offset). A stored block item is copied into pages
once (`SharedPages.acquire`, shared_pages.py); every request over it holds references to those pages, and the pages of a
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
from collections.abc import Callable
from dataclasses import dataclass

import torch

from serving.engine.copy_times import CopyTimes
from serving.engine.errors import PoolFull
from serving.engine.free_runs import FreeRuns
from serving.engine.prefix_cache import PrefixCache
from serving.engine.residency import Holder, Residency
from serving.engine.shared_pages import SharedPages
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
            # what eviction surely frees (cheap: it stops at what is missing); when that falls short, the exact
            # count, which also sees what becomes evictable once something else goes (a block read only by an
            # idle session's table) and what stays though it looks unread (a page a pinned user's key names)
            short = pages - self._free.count
            if self.residency.surely_freeable(short) < short and self.residency.freeable_pages() < short:
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
