"""The tiered KV store's index, mixed into TieredKVStore: which items it holds, in which tier, and their metadata.

Owns the start-up scan of the directory, indexing items other processes wrote since (adopt, rescan), each
entry's statistics for the eviction policy, and the lookups over the index (meta, tier_of, block_tier, in_memory, contains,
item_ids, size_info). Knows nothing of moving items between tiers, loading, writing or evicting them, nor of
the delete cascade: those are store.py's.
"""

from __future__ import annotations

import itertools
import logging
import threading
from pathlib import Path

from kvmem.errors import KVItemError, KVItemNotFound
from kvmem.kv.cascade import disk_metas
from kvmem.kv.eviction import EntryStats
from kvmem.kv.io import list_item_ids, read_manifest, sweep_stale_writes
from kvmem.kv.item import KVItem, KVItemMeta
from kvmem.kv.store_types import SizeInfo, TierSize

log = logging.getLogger("kvmem.kv.store")  # the store's log, as before the index moved here


class StoreIndex:
    """The index on TieredKVStore; the store provides what is declared here."""

    directory: Path
    _lock: threading.RLock
    _clock: itertools.count
    _resident: dict[str, dict[str, KVItem]]
    _on_disk: dict[str, KVItemMeta]
    _stats: dict[str, EntryStats]
    _scanned_at: int | None

    # -- index ---------------------------------------------------------------------------------------
    def _scan(self) -> None:
        swept = sweep_stale_writes(self.directory)
        if swept:
            log.warning("removed %d temporary file(s) of KV writes whose process died mid-write", swept)
        for item_id in list_item_ids(self.directory):
            try:
                meta = KVItemMeta.from_dict(read_manifest(self.directory, item_id)["meta"])
            except KVItemError as exc:
                log.warning("ignoring unreadable KV manifest %s: %s", item_id, exc)
                continue
            self._on_disk[item_id] = meta
            self._stats[item_id] = self._new_stats(meta)

    def adopt(self, item_id: str) -> bool:
        """Index `item_id` if another process (a peer replica over the shared data dir, `kvmem build`) wrote
        it after this store's scan; True when it is indexed now. The manifest is read outside the lock."""
        if self.contains(item_id):
            return True
        try:
            meta = KVItemMeta.from_dict(read_manifest(self.directory, item_id)["meta"])
        except KVItemError:
            return False
        self._index_found({item_id: meta})
        return True

    def rescan(self) -> int:
        """Index every item other processes wrote since this store's scan (their manifests are read outside
        the lock); returns how many were new. For a user this process has no block for yet."""
        try:
            stamp = self.directory.stat().st_mtime_ns  # a file added or removed changes it
        except OSError:
            return 0
        if stamp == self._scanned_at:  # nothing was added since the last look: no listing of the directory
            return 0
        with self._lock:
            indexed = set(self._indexed_metas())
        found = self._index_found(disk_metas(self.directory, skip=indexed))
        self._scanned_at = stamp
        return found

    def _index_found(self, metas: dict[str, KVItemMeta]) -> int:
        with self._lock:
            new = {i: m for i, m in metas.items() if i not in self._indexed_metas()}
            for item_id, meta in new.items():
                self._on_disk[item_id] = meta
                self._stats[item_id] = self._new_stats(meta)
        return len(new)

    def _new_stats(self, meta: KVItemMeta) -> EntryStats:
        now = next(self._clock)
        return EntryStats(
            num_bytes=meta.stored_bytes, num_tokens=meta.num_tokens, hits=0, last_access=now, inserted=now
        )

    def _touch(self, item_id: str) -> None:
        stats = self._stats[item_id]
        stats.hits += 1
        stats.last_access = next(self._clock)

    def meta(self, item_id: str) -> KVItemMeta:
        with self._lock:
            for tier in ("device", "host"):
                if item_id in self._resident[tier]:
                    return self._resident[tier][item_id].meta
            if item_id in self._on_disk:
                return self._on_disk[item_id]
        raise KVItemNotFound(f"KV item {item_id} is not stored")

    def tier_of(self, item_id: str) -> str | None:
        with self._lock:
            for tier in ("device", "host"):
                if item_id in self._resident[tier]:
                    return tier
            return "disk" if item_id in self._on_disk else None

    def in_memory(self, item_id: str) -> bool:
        """The item, and its parent if it has one, are in RAM or on the device (`get` reads no file)."""
        return self.block_tier(item_id) in ("device", "host")

    def block_tier(self, item_id: str) -> str | None:
        """The tier a `get` of the item reads from: the slowest of its own and its parent's fastest tiers
        ("device", "host", "disk"), or None when either is not indexed."""
        with self._lock:
            meta = self._on_disk.get(item_id)
            for tier in ("device", "host"):
                if item_id in self._resident[tier]:
                    meta = self._resident[tier][item_id].meta
            ids = [item_id] if meta is None or meta.parent_id is None else [item_id, meta.parent_id]
            tiers = [self.tier_of(i) for i in ids]
        order = ("device", "host", "disk")
        return None if None in tiers else max(tiers, key=order.index)

    def contains(self, item_id: str) -> bool:
        return self.tier_of(item_id) is not None

    def __contains__(self, item_id: str) -> bool:
        return self.contains(item_id)

    def _indexed_metas(self) -> dict[str, KVItemMeta]:
        """Every indexed item's metadata, whatever its tier. Lock held."""
        return {
            **self._on_disk,
            **{i: it.meta for t in ("device", "host") for i, it in self._resident[t].items()},
        }

    def item_ids(self, user_id: str | None = None) -> list[str]:
        """Indexed items (those `get` may serve), optionally of one user."""
        with self._lock:
            metas = self._indexed_metas()
        return sorted(i for i, m in metas.items() if user_id is None or m.user_id == user_id)

    def size_info(self) -> SizeInfo:
        with self._lock:
            sizes = {}
            for tier in ("device", "host"):
                items = self._resident[tier].values()
                sizes[tier] = TierSize(
                    len(items), sum(i.meta.num_tokens for i in items), sum(i.meta.stored_bytes for i in items)
                )
            metas = self._on_disk.values()
            sizes["disk"] = TierSize(
                len(metas), sum(m.num_tokens for m in metas), sum(m.stored_bytes for m in metas)
            )
        return SizeInfo(**sizes)
