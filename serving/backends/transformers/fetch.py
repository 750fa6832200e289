"""Where a request's stored block comes from in the transformers backend, and when.

The engine's page pool is the device tier: a block there is read by reference. The store keeps host RAM and
disk only (device_bytes=0), so a block comes from RAM or disk straight into pages, one device copy. Per block,
a load is weighed against prefilling its tokens as text (load_costs.py): the cheaper path is taken, so no
request waits on a tier slower than its own prefill. A block on disk starts loading into RAM on an I/O thread
as soon as a request names it (`prefetch_block`, called when the chat path reads the user's plan, before the
search, the layout and the admission), at a session's start or a prewarm (`warm_block`, which then copies it
into pages between two steps); a request over it joins that load. Files are never read on the model thread;
the copy into pages is admission's, on it. Counts per tier for /metrics (`kv_tier_stats`) and one block's tier
and path for the plan route (`block_residency`).

A mixin of TransformersBackend (backend.py): it uses its store, pool, I/O threads, model loop, head item and
`_resolve_item`, `_note_pooled`, `_unpool_if_gone`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from concurrent.futures import Future

from kvmem.errors import KVItemError, KVItemNotFound
from serving.backends.base import GenerationRequest
from serving.backends.stored import ResolvedBlock, fallback_kind
from serving.backends.transformers.load_costs import PROBE_TOKENS, TIERS, Decision, LoadCosts
from serving.engine.model_loop import LoopClosed

log = logging.getLogger("serving.backends.transformers.backend")  # one logger for the backend's lines

ARRIVALS = 4096  # blocks whose read from disk a request's arrival started, kept until it is resolved
STORE_TIERS = {"device": "pool", "host": "host", "disk": "disk"}  # no device tier in this store: see above


class EngineFetches:
    def _init_fetches(self) -> None:
        self.costs = LoadCosts()
        self._fetches: dict[str, Future] = {}  # item id -> its read from disk under way
        self._arrivals: dict[str, None] = {}  # blocks read from disk for a request not resolved yet (_count)
        self._fetch_lock = threading.Lock()
        self._lookups = {tier: {"hits": 0, "misses": 0} for tier in TIERS}
        self._paths: dict[tuple[str, str], int] = {}

    # -- where a block is, and which path it takes --------------------------------------------------------------
    def _tier_now(self, item_id: str) -> str | None:
        """ "pool" when its pages are resident, else the store's tier a get reads from ("host", "disk"), None
        when it is not stored."""
        if self.pool is not None and item_id in self.pool.shared:
            return "pool"
        return STORE_TIERS.get(self.store.block_tier(item_id))

    def decide_block(self, item_id: str) -> Decision:
        """Where the block is and whether a request over it loads it or prefills its tokens (load_costs.py),
        with the rates measured so far."""
        tier = self._tier_now(item_id)
        try:
            meta = self.store.meta(item_id)
        except KVItemError:
            return Decision(None, None, None, None)
        if tier is None:
            return Decision(None, None, None, None)
        if self.pool is not None:
            self.costs.measured("host", *self.pool.copy_sample())
        disk = self.store.disk_loads
        self.costs.measured("disk", disk["bytes"], disk["seconds"])
        head = self.head_item.num_tokens if self.head_item is not None else 0
        tokens = meta.num_tokens - (meta.parent_tokens or min(head, meta.num_tokens))  # what a recompute adds
        return self.costs.decide(tier, meta.stored_bytes, tokens)

    def _count(self, item_id: str, decision: Decision) -> None:
        """A request's lookup: a hit in the tier that held its block when the request arrived (on disk when its
        arrival started a read from disk, though the read may be done by now), a miss in each faster one (in all
        three when it is not stored); its path."""
        with self._fetch_lock:
            if self._arrivals.pop(item_id, 0) is None and decision.tier is not None:
                decision = dataclasses.replace(decision, tier="disk")
            found = TIERS.index(decision.tier) if decision.tier is not None else len(TIERS)
            for tier in TIERS[:found]:
                self._lookups[tier]["misses"] += 1
            if decision.tier is not None:
                self._lookups[decision.tier]["hits"] += 1
                key = (decision.tier, decision.path)
                self._paths[key] = self._paths.get(key, 0) + 1

    def block_residency(self, item_id: str) -> dict | None:
        """The plan route's view of a block: its tier, the path a request over it would take and the two
        estimates in seconds (Decision.to_dict); None before load."""
        if self.store is None:
            return None
        return self.decide_block(item_id).to_dict()

    def kv_tier_stats(self) -> dict | None:
        """Per tier ("pool", "host", "disk"): bytes, items, hits, misses, loads, bytes_loaded, load_seconds
        (a tier's loads are those *from* it: host, copies into pages; disk, file reads; the pool's are reads by
        reference, none); the paths taken, by tier; the cost model's rates. None before load."""
        if self.store is None or self.pool is None:
            return None
        sizes = self.store.size_info()
        pool, disk = self.pool, self.store.disk_loads
        with self._pooled_lock:
            pooled = sum(1 for i in self._pooled if i in pool.shared)
        held = {
            "pool": (pool.stats()["shared_bytes"], pooled, 0, 0, 0.0),
            "host": (
                sizes.host.num_bytes,
                sizes.host.num_items,
                pool.copies,
                pool.copied_bytes,
                pool.copied_seconds,
            ),
            "disk": (
                sizes.disk.num_bytes,
                sizes.disk.num_items,
                disk["loads"],
                disk["bytes"],
                disk["seconds"],
            ),
        }
        with self._fetch_lock:
            tiers = {
                tier: {
                    "bytes": nbytes,
                    "items": items,
                    **self._lookups[tier],
                    "loads": loads,
                    "bytes_loaded": loaded,
                    "load_seconds": seconds,
                }
                for tier, (nbytes, items, loads, loaded, seconds) in held.items()
            }
            paths = [{"tier": t, "path": p, "requests": n} for (t, p), n in sorted(self._paths.items())]
        return {"tiers": tiers, "paths": paths, "costs": self.costs.snapshot()}

    # -- loads ----------------------------------------------------------------------------------------------------
    def prefetch_block(self, item_id: str) -> None:
        """Start reading a stored block from disk into host RAM on an I/O thread, once: a request over it joins
        that read. Nothing when it is in RAM or in the pool, not stored, or before load. Never blocks on I/O."""
        if self.store is not None and self._tier_now(item_id) == "disk":
            with self._fetch_lock:
                self._arrivals[item_id] = None
                while len(self._arrivals) > ARRIVALS:  # prefetched for requests that never came
                    del self._arrivals[next(iter(self._arrivals))]
            self._fetch(item_id)

    def _fetch(self, item_id: str) -> Future:
        """The read of `item_id` from disk under way (store.get on an I/O thread), started if there is none."""
        with self._fetch_lock:
            future = self._fetches.get(item_id)
            started = future is None
            if started:
                future = self._io.submit(self.store.get, item_id)
                self._fetches[item_id] = future
        if started:  # outside the lock: a read already done runs the callback at once
            future.add_done_callback(lambda f: self._fetched(item_id, f))
        return future

    def _fetched(self, item_id: str, future: Future) -> None:
        with self._fetch_lock:
            if self._fetches.get(item_id) is future:
                del self._fetches[item_id]

    def warm_block(self, item_id: str) -> None:
        """A prewarm or a session's start: the stored block read into host RAM (joining a read under way), then
        copied into the pool's pages on the model thread between two steps, when pages are free (a prewarm
        evicts nothing), so that the user's next request reads it by reference."""
        if self.store is None:
            return
        try:
            if self._tier_now(item_id) == "disk":
                item = self._fetch(item_id).result()
            else:
                item = self.store.get(item_id)
        except KVItemError as exc:
            log.warning("prewarm of KV item %s failed: %s", item_id, exc)
            return
        if self.pool is None or item_id in self.pool.shared:
            return
        self._note_pooled(item)
        try:
            self._loop.call_soon(lambda: self._pool_in(item))
        except LoopClosed:
            pass

    def _pool_in(self, item) -> None:
        """On the model thread: `item` into pages, unread (evictable), unless a delete took it meanwhile."""
        from serving.engine.errors import PoolFull

        shared = self.pool.shared
        need = self.pool.pages_for(item.num_tokens)
        if item.item_id in shared or not self.store.contains(item.item_id) or self.pool.free_pages < need:
            return
        try:
            shared.release(shared.acquire(item).entry)
        except PoolFull:
            return
        self._unpool_if_gone(item.item_id)  # a delete that landed between the check and the copy

    def _probe_prefill(self) -> None:
        """The cost model's prefill rate on this machine: PROBE_TOKENS tokens prefilled in the engine, twice
        (the first also pays for warming up), the faster kept. At load, before the first request."""
        n = min(PROBE_TOKENS, self.max_context_tokens - 2)
        if n < 1:
            return
        ids = [self.handle.tokenizer.eos_token_id or 0] * n
        best = None
        for _ in range(2):
            started = time.perf_counter()
            self._engine_kv(ids, None)
            took = time.perf_counter() - started
            best = took if best is None else min(best, took)
        self.costs.observe_prefill(n, best)

    # -- a request's block -------------------------------------------------------------------------------------------
    async def _resolve_off_model_thread(self, req: GenerationRequest) -> ResolvedBlock:
        """The request's block, off the event loop and off the model thread: from the pool or RAM on a plain
        thread; from disk once the read its arrival started (or this one) is done; or, when that load costs
        more than prefilling the block's tokens, none (fallback "recompute": the prompt is prefilled as text,
        and the block is read into RAM in the background for the next request). Raises BlockNotFound. An
        adapter's weights are read and verified here too, on a plain thread, so the model thread only attaches
        them. With shared knowledge and no block, the stored knowledge item when it is in memory."""
        if req.adapter_id is not None and self.adapters is not None:
            await asyncio.to_thread(self.adapters.prefetch, req.user_id, req.adapter_id)
        if req.block_item_id is None or req.prompt.block_len == 0:
            if self.layout.knowledge_text and req.adapter_id is None:
                return await asyncio.to_thread(self._knowledge_item_for, req)
            return ResolvedBlock(None, None)
        item_id = req.block_item_id
        decision = await asyncio.to_thread(self.decide_block, item_id)
        self._count(item_id, decision)
        if decision.path == "recompute":
            log.info(
                "request %s: block %s prefilled as text: a load from %s (~%.4fs) costs more than its prefill (~%.4fs)",
                req.request_id,
                item_id,
                decision.tier,
                decision.load_s,
                decision.recompute_s,
            )
            if decision.tier == "disk":  # into RAM in the background, for the next request
                self._fetch(item_id)
            return ResolvedBlock(None, "recompute")
        if decision.tier == "disk":
            try:
                await asyncio.wrap_future(self._fetch(item_id))
            except KVItemNotFound:
                pass  # removed meanwhile: _resolve_item says so (BlockNotFound)
            except KVItemError as exc:  # its file is corrupt or mismatched: the store dropped it
                log.warning("KV fallback for request %s (user %s): %s", req.request_id, req.user_id, exc)
                return ResolvedBlock(None, fallback_kind(exc))
        if self.store.in_memory(item_id):
            return await asyncio.to_thread(self._resolve_item, req)
        return await asyncio.get_running_loop().run_in_executor(self._io, self._resolve_item, req)
