"""The transformers backend: the embedded default engine (CPU-capable), with KV-item injection.

Owns the model, the tiered KV store and the model thread (model_loop.py): every request is a generator that
hands its sequence to the model thread (steps.py), which decodes all running sequences in one batched forward
per step and prefills new ones in chunks in between (serving/engine/batcher.py), with block builds between
steps (builds.py). A bounded admission count gives 429s; a missing, corrupt or mismatched KV item means full
prefill. The page pool is the device tier of stored blocks: the store keeps host RAM and disk only, and a
block comes from either straight into pages, or is recomputed when that is cheaper (fetch.py).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from kvmem.errors import KVItemError, KvmemError
from kvmem.kv.cascade import matcher
from serving.backends.base import (
    SAMPLING_FEATURES,
    BackendError,
    GenerationRequest,
)
from serving.backends.stored import ResolvedBlock, StoredBlocksBackend
from serving.backends.transformers.adapters import adapter_slots, under_adapter, unload_erased
from serving.backends.transformers.builds import EngineBuilds
from serving.backends.transformers.config import TransformersBackendConfig
from serving.backends.transformers.fetch import EngineFetches
from serving.backends.transformers.steps import EngineRequests
from serving.engine.detok import TokenPieces
from serving.engine.model_loop import ModelLoop

if TYPE_CHECKING:
    from kvmem.kv.blocks import BuiltBlock
    from kvmem.kv.item import KVItemMeta

IO_THREADS = 2  # item loads and writes at once (each reads or writes one file; more would just contend)
POOLED_NOTES = 4096  # resolved items' metadata kept for the delete cascade before the non-resident ones go

log = logging.getLogger(__name__)

IO_NICE = 10  # the I/O threads' niceness, above the model thread's
# a built item's file is written in synced 8 MB pieces, busy at most this share of the time (st_write.py): on 2
# cores a 184 MB write at once took the CPU of a step or two of every stream (their longest gaps in a build)
WRITE_DUTY = 0.25


def _yield_to_the_model() -> None:
    """An I/O thread runs at a lower priority than the model thread (Linux: per-thread niceness). Hashing and
    writing a built 184 MB item on a 2-core machine took a core from the model thread's OpenMP team, whose
    every kernel then waited for its preempted thread: a stream's step went from ~0.1 s to 0.68 s."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), IO_NICE)
    except (AttributeError, OSError):  # not Linux, or not allowed: the same priority as the rest
        pass


class TransformersBackend(EngineFetches, EngineRequests, EngineBuilds, StoredBlocksBackend):
    name = "transformers"
    sampling_features = frozenset(SAMPLING_FEATURES)  # the decode loop applies them all (kvmem/kv/decode.py)

    def __init__(self, config: TransformersBackendConfig | None = None):
        self.config = config or TransformersBackendConfig()
        self._init_shared()  # model id, readiness, admission, the KV store's items (stored.py)
        self._loop = ModelLoop(prefill_budget_tokens=self.config.prefill_chunk_tokens)
        # the store's disk work (item loads, writes, fsync, SHA-256) runs here, never on the model thread
        self._io = ThreadPoolExecutor(
            max_workers=IO_THREADS, thread_name_prefix="kvmem-io", initializer=_yield_to_the_model
        )
        self.handle = self.layout = self.builder = self.adapters = self.pool = None
        self.head_item = None  # the shared head item (_make_head)
        self.engine_path: str | None = None  # "fast" or "generic" once loaded (_choose_layers)
        # the metadata of the items requests resolved, by id: what the delete cascade matches pool entries by
        # when the store no longer holds them (`_unpool`)
        self._pooled: dict[str, KVItemMeta] = {}
        self._pooled_lock = threading.Lock()
        self._gone: dict[str, None] = {}  # the last POOLED_NOTES item ids a delete took from the pool
        # the builds in flight, each with the event that cancels it (cancel_builds: shutdown)
        self._build_cancels: set[threading.Event] = set()
        self._build_cancels_lock = threading.Lock()
        self._eos: frozenset[int] = frozenset()
        self._init_fetches()  # the cost model, reads from disk under way, per-tier counts (fetch.py)
        from serving.engine.sessions import SessionCache

        self.sessions = SessionCache(self.config.session_kv_bytes, self.config.sessions_per_user)

    # -- lifecycle -----------------------------------------------------------------------------------------
    def load(self) -> None:
        """Load the model and its stores, on the model thread (see `_load`)."""
        with self._load_lock:
            if not self._ready.is_set():
                self._loop.call(self._load)
                self._probe_prefill()  # the cost model's prefill rate here (fetch.py)
                self._loop.call(lambda: None)  # the probe's pages are back

    def _load(self) -> None:
        """On the model thread, so that it is the only thread of the process that runs OpenMP parallel work:
        libgomp spins only 100 times (not ~3 ms) before sleeping once it manages more threads than there are
        cores, so with a second team (the thread that loaded the model, which packs its weights) every small
        parallel kernel of a step waited for a sleeping worker. Measured on 2 cores: oneDNN linears in a
        thread other than the loader's ran at ~1 core (1536x576, 8 rows: 0.52 vs 0.31 ms)."""
        from kvmem.kv import eos_token_ids
        from kvmem.models import load_model

        try:
            handle = load_model(self.config.model, device=self.config.device, dtype=self.config.dtype)
        except KvmemError as exc:
            raise BackendError(str(exc)) from exc
        _refuse_unless_the_engine_runs(handle)  # before any store is opened for it
        self._open_blocks(  # no device tier: the page pool is (fetch.py)
            handle,
            device="cpu",
            device_bytes=0,
            host_bytes=self.config.host_kv_bytes,
            disk_bytes=self.config.disk_kv_bytes,
            write_duty=WRITE_DUTY,
            pin_memory=str(handle.device).startswith("cuda"),  # copies into pages overlap
            user_bytes=self.config.kv_user_bytes,  # the quota holds in every tier: pool, host RAM, disk
        )
        self._eos = eos_token_ids(handle.model, handle.tokenizer)
        self.max_context_tokens = handle.max_context_tokens
        self.vocab_size = handle.model.config.get_text_config().vocab_size  # the logits' size
        self._pieces = TokenPieces(handle.tokenizer)
        self.adapters = adapter_slots(self.config.data_dir, handle)
        self.pool = self._make_pool(handle)
        self.head_item = self._make_head(handle)
        self._ready.set()
        log.info("transformers backend ready: %s on %s (%s)", self.model_id, handle.device, handle.dtype)

    def _make_pool(self, handle):
        """The engine's KV page pool."""
        import torch

        from serving.engine import graphs, prefill_graphs, warm
        from serving.engine.pages import PagePool, PoolShape

        shape = PoolShape.of_model(handle.model, self.config.kv_page_tokens)
        pool = PagePool(shape, self._pool_bytes(handle), device=handle.device)
        pool.reclaimers.append(self.sessions)  # live sessions' pages go before a request waits
        # per-user quota and eviction policy (serving/engine/residency.py)
        pool.residency.configure(self.config.kv_user_bytes, self.config.kv_evict_policy, self._kv_heat)
        self.engine_path = self._choose_layers(handle.model)  # before any graph is captured
        if self.config.cuda_graphs and pool.k.device.type == "cuda" and graphs.supports(handle.model):
            pool.graphs = graphs.DecodeGraphs(handle.model, pool)
            with torch.inference_mode():  # every bucket a step can reach: no capture after load
                captured = pool.graphs.warm(max_rows=self.config.max_queue)
            log.info(
                "CUDA graphs of decode steps captured: %d buckets; failed (eager steps): %s",
                captured,
                sorted(pool.graphs.failed) or "none",
            )
        # `--prefill-graphs`: lone prefill chunks over static buffers, their graphs captured here on a GPU
        pool.prefill_graphs = prefill_graphs.for_server(
            handle.model, pool, self.config, self.max_context_tokens
        )
        if pool.k.device.type == "cuda":  # what the device sets up on an eager step's first call, now
            log.info("eager step forms warmed in %.2f s", warm.warm_eager(handle.model, pool))
        log.info(
            "KV page pool: %d pages of %d tokens (%d MiB)",
            pool.num_pages,
            shape.page_tokens,
            pool.num_pages * shape.page_bytes >> 20,
        )
        return pool

    def _choose_layers(self, model) -> str:
        """The path the engine's steps take (`--engine-layers`): "fast" (serving/engine/models) or "generic"."""
        from serving.engine import models

        if self.config.engine_layers == "generic":
            models.disable(model)
            log.info("engine layers: generic path (--engine-layers generic)")
            return "generic"
        return models.enable(model).path  # logs the path, and why not when generic

    def _pool_bytes(self, handle) -> int:
        """`kv_pool_mb` when given; else on a GPU `kv_pool_fraction` of its free memory now (the model is
        loaded: pages.pool_bytes_on_device; the store keeps no device tier); else 1 GiB."""
        import torch

        from serving.engine.pages import CPU_POOL_MB, pool_bytes_on_device

        if self.config.kv_pool_mb is not None:
            return self.config.kv_pool_mb << 20
        device = torch.device(handle.device)
        if device.type != "cuda":
            return CPU_POOL_MB << 20
        free, _ = torch.cuda.mem_get_info(device)
        return pool_bytes_on_device(free, self.config.kv_pool_fraction)

    def _make_head(self, handle):
        """The K/V of the head every prompt starts with (system opening, system prompt, memory header:
        `PromptLayout.head_ids`), built once at load and shared by reference, as a block's pages are, by every
        engine request that has no block (a user without memories, a block not served), so that none
        re-encodes the system prompt. It holds no user's data: owned by no user (KNOWLEDGE_OWNER), never in
        the store, never counted as activation memory in `cached_tokens`. None without a pool, or with shared
        knowledge installed: there such a request starts from the stored knowledge item instead
        (`_knowledge_item_for`), as the blocks that have it as their parent do."""
        from kvmem.kv import build_item
        from kvmem.kv.knowledge import KNOWLEDGE_OWNER

        if self.layout.knowledge_text:
            return None
        return build_item(handle, self.layout.head_ids, user_id=KNOWLEDGE_OWNER)

    def _head_for(self, req: GenerationRequest):
        """The head item (see `_make_head`) when `req`'s prompt starts with its tokens, else None."""
        head = self.head_item
        if head is None or tuple(req.prompt.ids[: head.num_tokens]) != head.token_ids:
            return None
        return head

    def _knowledge_item_for(self, req: GenerationRequest) -> ResolvedBlock:
        """With shared knowledge installed, what an engine request without a block starts from: the stored
        knowledge item of the current layout when it is in memory and the prompt starts with its tokens,
        as the blocks that have it as their parent do (held by the request while it runs, as a block is); else
        nothing (the request prefills its prompt, knowledge included: not waiting on a file read for it, nor
        building it: the first block built under the layout builds it). Off the model thread."""
        from kvmem.kv.knowledge import knowledge_item_id

        item_id = knowledge_item_id(self.layout, self.handle.fingerprint)
        if item_id is None or not self.store.in_memory(item_id):
            return ResolvedBlock(None, None)
        try:
            item = self.store.get(item_id)
        except KVItemError:
            return ResolvedBlock(None, None)  # dropped meanwhile (the knowledge changed)
        if tuple(req.prompt.ids[: item.num_tokens]) != item.token_ids:
            return ResolvedBlock(None, None)  # laid out under other knowledge
        return ResolvedBlock(item, None)

    _kv_heat = None  # a user's expected reuse (the scheduler's heat), for kv_evict_policy "heat"

    def use_kv_heat(self, heat) -> None:
        """The pool's eviction under kv_evict_policy "heat" ranks users by `heat(user_id)` (scheduler/wiring.py
        gives the scheduler's heat of the user's memories); set before or after the model is loaded."""
        self._kv_heat = heat
        if self.pool is not None:
            self.pool.residency.heat = heat

    def pin_kv_user(self, user_id: str) -> None:
        """The user's kept K/V (block, cached prefixes, sessions) is not evicted for others' room, within
        their quota (serving/engine/residency.py); a delete of all their memories unpins them."""
        if self.pool is not None:
            self.pool.residency.pin(user_id)

    def engine_stats(self) -> dict[str, int] | None:
        """The KV page pool's accounting (serving/engine/pages.py), or None before the model is loaded."""
        return None if self.pool is None else self.pool.stats()

    async def aclose(self) -> None:
        self._loop.close()
        self._io.shutdown(wait=False, cancel_futures=True)

    # -- layout and blocks -----------------------------------------------------------------------------------
    @property
    def serves_adapters(self) -> bool:  # peft is installed (adapter_slots)
        return self.adapters is not None

    builds_under_adapter = True  # build_block(adapter_id=...): the block's K/V computed with the adapter on

    def build_block(
        self,
        user_id: str,
        block_texts: Sequence[str],
        memory_ids: Sequence[str] | None = None,
        adapter_id: str | None = None,
    ) -> BuiltBlock:
        """The block as a request under the user's adapter `adapter_id` (if any) computes it: its content
        address covers the adapter's served name (kvmem Fingerprint.adapter), so it is only injected under it."""
        self._require_ready()
        try:
            ids = None if memory_ids is None else list(memory_ids)
            from kvmem.kv.blocks import BuiltBlock

            served = None
            if adapter_id is not None:
                served, _ = under_adapter(self.adapters, self.builder, user_id, adapter_id)
            found = self._io.submit(
                self.builder.lookup, user_id, list(block_texts), ids, adapter=served
            ).result()
            if isinstance(found, BuiltBlock):  # a valid one is stored
                return found
            if adapter_id is None:  # chunked prefills in the engine's steps
                item = self._build_in_engine(found)
            else:  # the same, its tokens under the adapter's delta (serving/engine/lora.py)
                item = self._build_under_adapter(found, self._adapter_for_engine(user_id, adapter_id, found))
            return self._io.submit(self.builder.store_item, item).result()  # visible once written
        except (KvmemError, ValueError) as exc:
            raise BackendError(f"could not build the block for user {user_id!r}: {exc}") from exc

    def drop_block(self, item_id: str) -> None:
        self.sessions.drop_block(item_id)  # a session cache that began with the block goes with it
        if self.pool is not None:  # loaded: its pages go once the requests reading them are done
            self.pool.shared.drop(item_id)
            self.pool.prefix.drop_block(item_id)  # and the cached pages of prompts that began with it
        super().drop_block(item_id)

    def forget(self, user_id: str, memory_ids: Sequence[str] | None = None) -> list[str]:
        """The delete cascade: the store's (stored.py), live sessions' caches, the page pool (`_unpool`) and
        every page of the user's in the prefix cache (a page's K/V carry every token before it)."""
        self.sessions.forget(user_id, memory_ids)  # the delete cascade reaches live sessions' caches too
        forgotten = super().forget(user_id, memory_ids)
        self._unpool(forgotten, matcher(user_id, memory_ids))
        if self.pool is not None:
            self.pool.prefix.drop_user(user_id)
            if memory_ids is None:
                self.pool.residency.unpin(user_id)
        return forgotten

    def forget_adapters(self, user_id: str, adapters: Sequence[str]) -> list[str]:
        forgotten = super().forget_adapters(user_id, adapters)
        self._unpool(forgotten, matcher(user_id, [], adapters))
        if self.pool is not None:  # pages computed under the adapters
            self.pool.prefix.drop_user(user_id)
        unload_erased(self.adapters, adapters, self._loop.call_soon)  # their weights leave the model too
        return forgotten

    def _unpool(self, item_ids: Sequence[str], match: Callable[[KVItemMeta], bool]) -> None:
        """Before a delete returns, every resident pool entry of what it deleted leaves the pool's index (no new
        reader takes it; its pages free once its readers are done, SharedPages.drop): the items the store's
        cascade named (earlier plans' blocks, not only the current one), and the items that requests resolved
        whose metadata `match`es though the store no longer holds them (dropped by the store, or dropped by a
        plan change while a request that had resolved them was admitted: the store cannot name them)."""
        if self.pool is None:
            return
        with self._pooled_lock:
            matched = [i for i, meta in self._pooled.items() if match(meta)]
            for item_id in [*item_ids, *matched]:
                self._pooled.pop(item_id, None)
                self._gone[item_id] = None
            while len(self._gone) > POOLED_NOTES:
                del self._gone[next(iter(self._gone))]
        for item_id in dict.fromkeys([*item_ids, *matched]):
            self.pool.shared.drop(item_id)

    def _unpool_if_gone(self, item_id: str) -> None:
        """When a request ends: the item it read leaves the pool if a delete took it meanwhile (a request that
        resolved it before the delete and was admitted after it put it back)."""
        with self._pooled_lock:
            gone = item_id in self._gone
        if gone and self.pool is not None:
            self.pool.shared.drop(item_id)

    def _resolve_item(self, req: GenerationRequest) -> ResolvedBlock:
        """stored.py's, noting the metadata of the item a request will take into the pool (`_unpool`)."""
        resolved = super()._resolve_item(req)
        if resolved.item is not None:
            self._note_pooled(resolved.item)
        return resolved

    def _note_pooled(self, item) -> None:
        """`item` may enter the pool: its metadata noted for the delete cascade (`_unpool`)."""
        with self._pooled_lock:
            if len(self._pooled) >= POOLED_NOTES:  # keep the notes of the entries still resident
                resident = [i for i in self._pooled if i in self.pool.shared]
                self._pooled = {i: self._pooled[i] for i in resident}
            self._pooled[item.item_id] = item.meta


def _refuse_unless_the_engine_runs(handle) -> None:
    """Every request of this backend runs in the engine: a model whose attention it cannot run
    (`runner.supports`) is refused with what it has and where it can be served."""
    from serving.engine import runner

    if runner.supports(handle.model):
        return
    layers = sorted(set(getattr(handle.model.config.get_text_config(), "layer_types", None) or []))
    raise BackendError(
        f"the transformers backend cannot serve {handle.model_id}: its engine runs causal attention over every "
        "past position or a sliding window of them, called through transformers' attention interface, and this "
        f"model has layer types {layers} and attention {handle.model.config._attn_implementation!r}; serve it "
        "with --backend vllm"
    )
