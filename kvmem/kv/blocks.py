"""Build (or find) a user's memory block as a stored KV item: layout -> ids -> content address -> prefill.

The one build path shared by the offline build job, the serving backend and the scheduler worker.
Knows nothing of how memories were chosen.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from kvmem.errors import KVItemError
from kvmem.kv.item import KVItem, KVItemMeta, item_from_kv, item_id_for
from kvmem.kv.layout import PromptLayout
from kvmem.kv.prefill import build_item
from kvmem.kv.store import TieredKVStore

if TYPE_CHECKING:
    from kvmem.models import ModelHandle


@dataclass(frozen=True)
class PendingBlock:
    """A block to prefill: its ids, and the stored item of a prefix of its memories to prefill over."""

    user_id: str
    memory_ids: tuple[str, ...]
    ids: list[int]
    prefix: KVItem | None
    adapter: str = ""  # the LoRA adapter (served name) the caller switches on for prefill(); "" = base


@dataclass(frozen=True)
class BuiltBlock:
    item_id: str
    memory_ids: tuple[str, ...]
    num_tokens: int
    num_bytes: int
    built: bool  # False when a valid stored item was reused
    token_ids: tuple[int, ...] = ()  # the block's ids, so a plan can carry them and requests skip tokenizing
    # the first tokens, whose K/V are a shared parent's (the knowledge item), not counted in num_bytes: a
    # block costs its own tokens' bytes, the knowledge is counted once
    shared_tokens: int = 0


def text_memory_id(text: str) -> str:
    """A stable pseudo id for a memory given only as text (offline builds from raw texts)."""
    return "text:" + hashlib.sha256(text.encode()).hexdigest()[:16]


class BlockBuilder:
    """Thread-safe if the model's forward is (callers serialize model use; see the serving backend)."""

    def __init__(
        self, handle: ModelHandle, layout: PromptLayout, store: TieredKVStore, *, share_knowledge: bool = True
    ):
        """With knowledge in `layout` and `share_knowledge`, blocks are stored as children of the knowledge
        item (kvmem.kv.knowledge): their files hold the user's own tokens' K/V only."""
        self.handle, self.layout, self.store = handle, layout, store
        self.share_knowledge = share_knowledge and bool(layout.knowledge_ids)

    def block_item_id(
        self, user_id: str, texts: Sequence[str], memory_ids: Sequence[str], adapter: str | None = None
    ) -> tuple[str, list[int]]:
        """The content address of the block (under the LoRA adapter named `adapter`, if any) and its ids."""
        ids = self.layout.block_ids(texts)
        fingerprint = self.handle.fingerprint.under(adapter)
        return item_id_for(user_id, fingerprint, tuple(ids), tuple(memory_ids)), ids

    def _prefix_item(self, user_id: str, memory_ids: tuple[str, ...], ids: list[int], adapter: str = ""):
        """The user's stored item (under the same adapter) for the longest proper prefix of these memories, if
        its tokens match."""
        best = None
        for item_id in self.store.item_ids(user_id):
            try:
                meta = self.store.meta(item_id)
            except KVItemError:
                continue
            n = len(meta.memory_ids)
            if (
                meta.fingerprint.adapter == adapter
                and 0 < n < len(memory_ids)
                and meta.memory_ids == memory_ids[:n]
                and (best is None or n > best[0])
            ):
                best = (n, item_id)
        if best is None:
            return None
        try:
            item = self.store.get(best[1])
        except KVItemError:
            return None
        return item if tuple(ids[: item.num_tokens]) == item.token_ids else None

    def find(
        self,
        user_id: str,
        texts: Sequence[str],
        memory_ids: Sequence[str],
        *,
        verify: bool = False,
        adapter: str | None = None,
    ) -> BuiltBlock | None:
        """The stored block for these memories, or None; never prefills (needs the tokenizer and the
        fingerprint only). `verify`: an item only on disk must pass its checksums (a bad one is removed)."""
        if len(memory_ids) != len(texts):
            raise ValueError(f"{len(texts)} texts but {len(memory_ids)} memory ids")
        return self._find(user_id, texts, memory_ids, verify=verify, adapter=adapter)[0]

    def _find(
        self,
        user_id: str,
        texts: Sequence[str],
        memory_ids: Sequence[str],
        *,
        verify: bool,
        adapter: str | None = None,
    ) -> tuple[BuiltBlock | None, str, list[int]]:
        item_id, ids = self.block_item_id(user_id, texts, memory_ids, adapter)
        if not self.store.adopt(item_id):  # adopt: a peer replica may have built it into the shared dir
            return None, item_id, ids
        if not verify or self.store.tier_of(item_id) != "disk" or self.store.is_valid_on_disk(item_id):
            try:
                meta = self.store.meta(item_id)
                if meta.parent_id is not None and not self.store.adopt(meta.parent_id):
                    return None, item_id, ids  # servable again once its parent is rebuilt (build)
                return self._stored_block(meta, ids), item_id, ids
            except KVItemError:
                pass
        self.store.remove(item_id)
        return None, item_id, ids

    def build(
        self,
        user_id: str,
        texts: Sequence[str],
        memory_ids: Sequence[str] | None = None,
        *,
        verify_existing: bool = False,
    ) -> BuiltBlock:
        """Build the block for these memories unless a valid one is stored. Raises InvalidBlock, StorageError."""
        found = self.lookup(user_id, texts, memory_ids, verify_existing=verify_existing)
        if isinstance(found, BuiltBlock):
            return found
        return self.store_item(self.prefill(found))

    # The three parts of build(), for callers that run them on different threads (the serving backend: the
    # store's reads and writes on I/O threads, only the prefill on the model thread).
    def lookup(
        self,
        user_id: str,
        texts: Sequence[str],
        memory_ids: Sequence[str] | None = None,
        *,
        verify_existing: bool = False,
        adapter: str | None = None,
    ) -> BuiltBlock | PendingBlock:
        """The stored block if a valid one is there, else what prefill() needs (with the user's stored item
        for the longest prefix of these memories, loaded). Store reads only, no model. `adapter`: the block
        as the model computes it with that LoRA adapter on (its own content address; see PendingBlock)."""
        if memory_ids is None:
            memory_ids = [text_memory_id(t) for t in texts]
        if len(memory_ids) != len(texts):
            raise ValueError(f"{len(texts)} texts but {len(memory_ids)} memory ids")
        found, item_id, ids = self._find(user_id, texts, memory_ids, verify=verify_existing, adapter=adapter)
        if found is not None:
            return found
        memory_ids, adapter = tuple(memory_ids), adapter or ""
        prefix = self._prefix_item(user_id, memory_ids, ids, adapter)
        return PendingBlock(user_id, memory_ids, ids, prefix, adapter)

    def stored_parent(self, pending: PendingBlock) -> tuple[KVItem | None, bool]:
        """(the stored knowledge item the block is a child of, or None; whether the layout has knowledge that
        is not stored yet and must be built first). File reads only: for an I/O thread."""
        if not self.share_knowledge or pending.adapter:
            return None, False
        from kvmem.kv.knowledge import knowledge_item_id

        item_id = knowledge_item_id(self.layout, self.handle.fingerprint)
        if item_id is None:
            return None, False
        if self.store.contains(item_id):
            try:
                parent = self.store.get(item_id)
            except KVItemError:
                return None, True  # dropped by the store: rebuilt
            return (parent if tuple(pending.ids[: parent.num_tokens]) == parent.token_ids else None), False
        return None, True

    def item_from_kv(self, pending: PendingBlock, kv, parent: KVItem | None) -> KVItem:
        """The block's item from the K/V the engine computed over `pending.prefix or parent`: of all its
        tokens, or of those after `parent`'s only; a child of `parent` as `prefill` makes it."""
        own_start = len(pending.ids) - kv.shape[3]
        item = item_from_kv(
            pending.ids,
            kv,
            user_id=pending.user_id,
            memory_ids=pending.memory_ids,
            fingerprint=self.handle.fingerprint.under(pending.adapter),
            own_start=own_start,
        )
        if own_start and (parent is None or own_start != parent.num_tokens):
            raise ValueError(f"K/V of the last {kv.shape[3]} tokens need a parent of {own_start} tokens")
        return self._child_of(item, parent)

    def prefill(self, pending: PendingBlock) -> KVItem:
        """The block's KV item (the model's part; nothing stored). Under shared knowledge it is the knowledge
        item's child (its file will hold the user's own tokens' K/V only); the knowledge item is built here
        if it is not stored yet (model work). Under an adapter (`pending.adapter`, which the caller has
        switched on) the whole block is prefilled: the shared knowledge item is the base model's."""
        parent = None
        if self.share_knowledge and not pending.adapter:
            from kvmem.kv.knowledge import ensure_knowledge_item

            parent = ensure_knowledge_item(self.handle, self.layout, self.store)
            if parent is not None and tuple(pending.ids[: parent.num_tokens]) != parent.token_ids:
                parent = None  # laid out under other knowledge (it changed meanwhile): a plain item
        item = build_item(
            self.handle,
            pending.ids,
            user_id=pending.user_id,
            memory_ids=pending.memory_ids,
            prefix=pending.prefix or parent,
            fingerprint=self.handle.fingerprint.under(pending.adapter),
        )
        return self._child_of(item, parent)

    @staticmethod
    def _child_of(item: KVItem, parent: KVItem | None) -> KVItem:
        if parent is not None:  # its own tokens' K/V (a tensor of their own), the parent's by reference
            k = parent.num_tokens
            meta = replace(item.meta, parent_id=parent.item_id, parent_tokens=k)
            own = item.kv if item.own_start == k else item.kv[:, :, :, k:].clone()
            item = KVItem(meta, item.token_ids, own, parent)
        return item

    def cut(self, item_id: str, memory_ids: Sequence[str], texts: Sequence[str]) -> BuiltBlock | None:
        """The block of the first memories of the stored block `item_id` (`memory_ids`, a proper prefix of its
        own, and their `texts`), made from its K/V without a prefill, and stored. Exact: causal attention gives
        a prefix's tokens the K/V a prefill of the prefix alone computes, and the layout encodes each memory's
        line on its own, so the prefix's ids are the block's first ids. For a block one of whose later memories
        changed: the memories before it stay served from KV, and its rebuild prefills only what follows them
        (`lookup` finds the cut as the longest stored prefix). None when the item is gone or unreadable, or
        its ids do not begin with the prefix's (laid out under other knowledge). Raises StorageError (the
        write), ValueError (`memory_ids` not a proper prefix of the item's)."""
        memory_ids = tuple(memory_ids)
        if len(memory_ids) != len(texts):
            raise ValueError(f"{len(texts)} texts but {len(memory_ids)} memory ids")
        try:
            item = self.store.peek(item_id)
        except KVItemError:
            return None
        meta = item.meta
        if not 0 < len(memory_ids) < len(meta.memory_ids) or meta.memory_ids[: len(memory_ids)] != memory_ids:
            raise ValueError(f"{memory_ids} is not a proper prefix of the memories of KV item {item_id}")
        ids, own = tuple(self.layout.block_ids(texts)), item.own_start
        if len(ids) <= own or ids != item.token_ids[: len(ids)]:
            return None
        kv = item.kv[:, :, :, : len(ids) - own].clone()  # its own tensor: the item it came from is deleted
        prefix = item_from_kv(
            ids, kv, user_id=meta.user_id, memory_ids=memory_ids, fingerprint=meta.fingerprint, own_start=own
        )
        if own:
            prefix = self._child_of(prefix, item.parent)
        if self.store.contains(prefix.item_id):
            return self._stored_block(self.store.meta(prefix.item_id), ids)
        return self.store_item(prefix)

    @staticmethod
    def _stored_block(meta: KVItemMeta, ids: Sequence[int]) -> BuiltBlock:
        """The block an already stored item is (found, not built)."""
        return BuiltBlock(
            meta.item_id,
            tuple(meta.memory_ids),
            meta.num_tokens,
            meta.stored_bytes,
            False,
            tuple(ids),
            meta.parent_tokens,
        )

    def store_item(self, item: KVItem) -> BuiltBlock:
        """Write the item (file, fsync, SHA-256) and index it: readers see it once it is fully written."""
        self.store.put(item)
        return BuiltBlock(
            item.item_id,
            item.meta.memory_ids,
            item.num_tokens,
            item.meta.stored_bytes,
            built=True,
            token_ids=item.token_ids,
            shared_tokens=item.meta.parent_tokens,
        )
