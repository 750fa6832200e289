"""What the in-process engines (transformers, vLLM) share: the model named as served, readiness, a bounded
admission count (429), the prompt layout, and the KV items of this process's tiered store (has, drop, forget,
drop listeners, and the one resolver of a request's block item both engines use).

Knows nothing of how an engine generates. A subclass's config has `model`, `data_dir` and `max_queue`; its
`load()` sets `self.store` and sets `self._ready` once the engine can serve.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from kvmem.datadir import DataDir
from kvmem.errors import FingerprintMismatch, KVItemCorrupt, KVItemError, KVItemNotFound
from serving.backends.base import (
    Backend,
    BackendError,
    BlockNotFound,
    GenerationRequest,
    LaidOutPrompt,
    NotReady,
    PromptTooLong,
    QueueFull,
)

if TYPE_CHECKING:
    from kvmem.kv.item import KVItem

log = logging.getLogger(__name__)

DEFAULT_MODEL_ID = "SmolLM2-135M-Instruct"


def served_model_id(model: str | None) -> str:
    """A local path is served under its directory name; aliases and HF ids as given; None is the default model."""
    if model and Path(model).exists():
        return Path(model.rstrip("/")).name
    return model or DEFAULT_MODEL_ID


def fallback_kind(exc: KVItemError) -> str:
    """The KV_FALLBACK_KINDS category of a store error (the detail goes to the log, never to a metric label)."""
    for kind, cls in (
        ("not_found", KVItemNotFound),
        ("corrupt", KVItemCorrupt),
        ("fingerprint_mismatch", FingerprintMismatch),
    ):
        if isinstance(exc, cls):
            return kind
    return "other"


class ResolvedBlock(NamedTuple):
    """A request's block as an engine will use it: `item` to inject, or None with `fallback` (the
    KV_FALLBACK_KINDS reason the prompt is prefilled in full instead; None: the request names no block)."""

    item: KVItem | None
    fallback: str | None


class StoredBlocksBackend(Backend):
    config: Any
    handle: Any = None  # the loaded model (kvmem.models.ModelHandle), set by the subclass's load()
    finds_stored_blocks = True  # items are files under the data dir: a restart finds them again

    def _init_shared(self) -> None:
        """Call first in the subclass's __init__, once `self.config` is set."""
        self.model_id = served_model_id(self.config.model)
        self.max_context_tokens = 0
        self._ready = threading.Event()
        self._load_lock = threading.Lock()
        self._admitted = 0
        self._admit_lock = threading.Lock()
        self.store: Any = None
        self.knowledge_generation = 0  # layouts switched to since load (reload_knowledge)
        self._knowledge_stamp: Any = None
        self._drop_listeners: list[Callable[[str, str, str], None]] = []

    def fingerprint_digest(self) -> str | None:
        return None if self.handle is None else self.handle.fingerprint.digest

    def kv_bytes_per_token(self) -> int | None:
        return None if self.handle is None else self.handle.kv_bytes_per_token

    # -- readiness and admission ---------------------------------------------------------------------------
    def is_ready(self) -> bool:
        return self._ready.is_set()

    def _require_ready(self) -> None:
        if not self._ready.is_set():
            raise NotReady("the model is still loading")

    def _admit(self) -> None:
        with self._admit_lock:
            if self._admitted >= self.config.max_queue:
                raise QueueFull(f"the generation queue is full ({self.config.max_queue} requests)")
            self._admitted += 1

    def _release(self) -> None:
        with self._admit_lock:
            self._admitted -= 1

    @property
    def queue_depth(self) -> int:
        return self._admitted

    # -- layout (self.handle's tokenizer, self.layout: a kvmem PromptLayout, both set by load) -------------
    def count_tokens(self, text: str) -> int:
        self._require_ready()
        from kvmem.kv.layout import memory_line

        return len(self.handle.tokenizer(memory_line(text), add_special_tokens=False)["input_ids"])

    def layout_prompt(
        self,
        block_texts: Sequence[str],
        text_texts: Sequence[str],
        messages: Sequence[dict[str, str]],
        block_ids: Sequence[int] | None = None,
    ) -> LaidOutPrompt:
        self._require_ready()
        layout = self.layout  # one layout for the whole prompt, even if the knowledge switches meanwhile
        head = layout.head_ids
        if block_ids is not None and tuple(block_ids[: len(head)]) != head:
            block_ids = None  # laid out under other knowledge: the block is laid out again, under this one
        laid = layout.prompt(block_texts, text_texts, messages, block_ids=block_ids)
        if len(laid.ids) >= self.max_context_tokens:
            raise PromptTooLong(len(laid.ids), self.max_context_tokens)
        return LaidOutPrompt(ids=laid.ids, block_len=laid.block_len)

    # -- shared knowledge ------------------------------------------------------------------------------------
    def reload_knowledge(self) -> bool:
        """Switch to the installed knowledge (kvmem.kv.knowledge) if it changed: a stat when it did not. The
        new layout serves every prompt laid out from now on; blocks are built under it (the new knowledge item
        with the first of them); the old knowledge item and its children leave the store. A block laid out under
        the old knowledge is never served with a new prompt (`layout_prompt` lays the block out again, and the
        item's tokens are then not the prompt's: prefix_mismatch, full prefill). Returns whether it switched.
        An unreadable install is logged and the current knowledge kept."""
        if not self._ready.is_set():
            return False
        from kvmem.kv.blocks import BlockBuilder
        from kvmem.kv.knowledge import KnowledgeFileError, installed, installed_stamp, knowledge_item_id
        from kvmem.kv.layout import PromptLayout

        root = DataDir.at(self.config.data_dir).root
        stamp = installed_stamp(root)
        if stamp == self._knowledge_stamp:
            return False
        self._knowledge_stamp = stamp
        try:
            texts = installed(root)
        except KnowledgeFileError as exc:
            log.error("installed knowledge unreadable; still serving the current one: %s", exc)
            return False
        old = self.layout
        layout = PromptLayout(old.tokenizer, old.system_prompt, old.version, knowledge=texts)
        if layout.knowledge_text == old.knowledge_text:
            return False
        builder = BlockBuilder(self.builder.handle, layout, self.store)
        self.builder, self.layout = builder, layout
        self.knowledge_generation += 1
        stale = knowledge_item_id(old, self.builder.handle.fingerprint)
        if stale is not None:
            children = [i for i in self.store.item_ids() if self._parent_of(i) == stale]
            for item_id in [*children, stale]:
                self.drop_block(item_id)
        log.info("knowledge switched (%d texts); blocks rebuild under it", len(texts))
        return True

    def _parent_of(self, item_id: str) -> str | None:
        try:
            return self.store.meta(item_id).parent_id
        except KVItemError:
            return None

    # -- stored blocks -------------------------------------------------------------------------------------
    def _resolve_item(self, req: GenerationRequest) -> ResolvedBlock:
        """The request's block item from this process's store, checked: the request's user's, and holding the
        prompt's first tokens. Blocking (a tier promotion may read files): call it off the event loop unless
        `store.on_device`. The detail of a fallback goes to the log line only: the kind is a metrics label.
        Raises BlockNotFound when the item is not stored (dropped since the request was prepared: its texts
        may be deleted memories, so the request is prepared again, not prefilled)."""
        if req.block_item_id is None or req.prompt.block_len == 0:
            return ResolvedBlock(None, None)
        try:
            item = self.store.get(req.block_item_id)
        except KVItemError as exc:
            if isinstance(exc, KVItemNotFound):
                log.info("KV item of request %s (user %s) is gone: %s", req.request_id, req.user_id, exc)
                raise BlockNotFound(req.block_item_id) from exc
            log.warning("KV fallback for request %s (user %s): %s", req.request_id, req.user_id, exc)
            return ResolvedBlock(None, fallback_kind(exc))
        if item.meta.user_id != req.user_id:  # isolation: never inject another user's item
            log.error("KV item %s belongs to another user; refusing it for %s", item.item_id, req.user_id)
            return ResolvedBlock(None, "wrong_user")
        if tuple(req.prompt.ids[: item.num_tokens]) != tuple(item.token_ids):  # e.g. under other knowledge
            log.warning("KV item %s is not the prompt's block (request %s)", item.item_id, req.request_id)
            return ResolvedBlock(None, "prefix_mismatch")
        return ResolvedBlock(item, None)

    def find_block(self, user_id: str, block_texts: Sequence[str], memory_ids: Sequence[str]) -> Any:
        """The stored, valid block for these memories (a kvmem BuiltBlock) or None; never prefills (restoring
        plans at start). `self.builder` is the kvmem BlockBuilder `load()` set. Raises NotReady before it."""
        self._require_ready()
        return self.builder.find(user_id, list(block_texts), list(memory_ids), verify=True)

    def stored_memory_ids(self, user_id: str) -> list[tuple[str, ...]]:
        """The memory ids of the user's stored blocks, newest first (restoring plans at start)."""
        if self.store is None:
            return []
        self.store.rescan()  # blocks peer replicas wrote into the shared data dir since this one's start
        metas = []
        for item_id in self.store.item_ids(user_id):
            try:
                metas.append(self.store.meta(item_id))
            except KVItemError:
                continue
        return [m.memory_ids for m in sorted(metas, key=lambda m: -m.created_at)]

    def drop_block(self, item_id: str) -> None:
        """Forget the item (an engine-side copy cached under it becomes unreachable with it)."""
        if self.store is not None:
            self.store.remove(item_id)

    def cut_block(self, item_id: str, memory_ids: Sequence[str], texts: Sequence[str]) -> Any:
        """The block of the item's first memories, from its K/V (kvmem's BlockBuilder.cut), or None."""
        if self.store is None:
            return None
        return self.builder.cut(item_id, memory_ids, texts)

    def has_block(self, item_id: str) -> bool:
        """True while `item_id` is stored (in the store's index). Never blocks on I/O; False before `load()`."""
        return self.store is not None and self.store.contains(item_id)

    def forget(self, user_id: str, memory_ids: Sequence[str] | None = None) -> list[str]:
        """The delete cascade: the store's, or, before `load()`, the item files on disk."""
        if self.store is not None:
            return self.store.forget(user_id, memory_ids)
        from kvmem.kv.cascade import forget_on_disk  # not loaded yet: no index, only files

        return forget_on_disk(DataDir.at(self.config.data_dir).kv_dir, user_id, memory_ids)

    def forget_adapters(self, user_id: str, adapters: Sequence[str]) -> list[str]:
        """The delete cascade for erased LoRA adapter versions: every stored block of `user_id` built under one
        of `adapters` (served names) is deleted before this returns. Returns the item ids, sorted."""
        if not adapters:
            return []
        if self.store is not None:
            return self.store.forget(user_id, [], adapters)
        from kvmem.kv.cascade import forget_on_disk

        return forget_on_disk(DataDir.at(self.config.data_dir).kv_dir, user_id, [], adapters)

    def subscribe_dropped(self, callback: Callable[[str, str, str], None]) -> Callable[[], None]:
        self._drop_listeners.append(callback)
        return lambda: self._drop_listeners.remove(callback) if callback in self._drop_listeners else None

    def _open_blocks(self, handle, **tiers) -> None:
        """Over a loaded model `handle`: the KV store (`tiers`: KVStoreConfig's tier fields and write_duty), the
        prompt layout (with the deployment's installed knowledge) and the block builder, as self.handle, store,
        layout and builder. Raises BackendError when the store cannot be opened."""
        from kvmem.errors import KvmemError
        from kvmem.kv import KVStoreConfig, PromptLayout, TieredKVStore
        from kvmem.kv.blocks import BlockBuilder
        from kvmem.kv.knowledge import installed  # the deployment's shared knowledge (kvmem build)
        from kvmem.kv.layout import DEFAULT_SYSTEM_PROMPT

        data = DataDir.at(self.config.data_dir)
        try:
            store = TieredKVStore(KVStoreConfig(directory=str(data.kv_dir), **tiers), handle.fingerprint)
        except KvmemError as exc:
            raise BackendError(str(exc)) from exc
        self.handle, self.store = handle, store
        store.subscribe_drops(self._on_store_drop)
        self.layout = PromptLayout(
            handle.tokenizer,
            self.config.system_prompt or DEFAULT_SYSTEM_PROMPT,
            knowledge=installed(data.root),
        )
        # under knowledge, a block is the knowledge item's child on disk; store.get joins them
        self.builder = BlockBuilder(handle, self.layout, store)

    def _on_store_drop(self, dropped: Any) -> None:
        for callback in list(self._drop_listeners):
            callback(dropped.item_id, dropped.user_id, dropped.reason)
