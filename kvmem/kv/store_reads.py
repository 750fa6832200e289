"""The tiered KV store's disk reads, mixed into TieredKVStore: an item read back from its files.

Owns `get`'s disk path (the test seam before a read, the read itself, its count in `disk_loads`, a child's
parent check), verifying items on disk without loading them (`is_valid_on_disk`) and the integrity check over
every file. A file that cannot be used (corrupt, mismatched, gone) drops its item from every tier and the
index, reported to the drop listeners with the reason. Knows nothing of which tier an item is promoted to,
of budgets or eviction: those are store.py's.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from kvmem.errors import FingerprintMismatch, KVItemCorrupt, KVItemError, KVItemNotFound
from kvmem.kv.eviction import EntryStats
from kvmem.kv.fingerprint import Fingerprint
from kvmem.kv.io import list_item_ids, load_item, verify_item
from kvmem.kv.item import KVItem, KVItemMeta
from kvmem.kv.store_types import IntegrityReport, KVStoreConfig

log = logging.getLogger("kvmem.kv.store")  # the store's log, as before the reads moved here


def _reason(exc: KVItemError) -> str:
    if isinstance(exc, FingerprintMismatch):
        return "fingerprint_mismatch"
    return "not_found" if isinstance(exc, KVItemNotFound) else "corrupt"


class StoreReads:
    """The disk reads on TieredKVStore; the store provides what is declared here, and _drop, _delete_files,
    _report_drops, _check_parent and _host_copy."""

    config: KVStoreConfig
    fingerprint: Fingerprint
    directory: Path
    _lock: threading.RLock
    _on_disk: dict[str, KVItemMeta]
    _stats: dict[str, EntryStats]
    num_hits: dict[str, int]
    disk_loads: dict[str, float]
    before_disk_read: Callable[[str], None] | None
    has_device_tier: bool

    def _read_from_disk(self, item_id: str, indexed: KVItemMeta | None) -> KVItem:
        """`get`'s read of an item's files (`indexed`: its meta in the index when the read began), on the store's
        device (without a device tier: the host copy). An unusable file drops the item, unless it was rebuilt
        under the same id meanwhile, and the error is raised. Runs outside the lock."""
        if self.before_disk_read is not None:
            self.before_disk_read(item_id)
        started = time.perf_counter()
        try:
            item = load_item(
                self.directory,
                item_id,
                self.fingerprint,
                device=self.config.device if self.has_device_tier else "cpu",
                verify_checksum=self.config.verify_checksum,
            )
        except KVItemError as exc:
            unlink: list[str] = []
            with self._lock:
                self.num_hits["miss"] += 1
                # still indexed as it was when the read began: its files are unusable or gone (not an item
                # rebuilt under the same id since, whose files a read of the old ones must not delete)
                if item_id in self._stats and self._on_disk.get(item_id) is indexed:
                    log.warning("dropping unusable KV item %s: %s", item_id, exc)
                    self._drop(item_id, unlink, reason=_reason(exc))
            self._delete_files(unlink)
            self._report_drops()
            raise
        with self._lock:
            self.disk_loads["loads"] += 1
            self.disk_loads["bytes"] += item.resident_bytes
            self.disk_loads["seconds"] += time.perf_counter() - started
        if item.meta.parent_id is not None:  # a child's file holds its own K/V: check its parent's
            self._check_parent(item)
        if not self.has_device_tier:
            item = self._host_copy(item)
        return item

    def is_valid_on_disk(self, item_id: str) -> bool:
        """True when the item's files verify (resumable builds, restores): io.verify_item, which does not read
        the K/V into memory; `get` verifies again when it loads the item."""
        try:
            verify_item(self.directory, item_id, self.fingerprint)
            return True
        except KVItemError:
            return False

    def check_integrity(self, *, drop_corrupt: bool = True) -> IntegrityReport:
        """Verify every item on disk (checksum, shapes, fingerprint); optionally drop the bad ones."""
        ok, corrupt = [], []
        for item_id in sorted(set(list_item_ids(self.directory)) | set(self._on_disk)):
            try:
                load_item(self.directory, item_id, self.fingerprint, device="cpu", verify_checksum=True)
                ok.append(item_id)
            except (KVItemCorrupt, KVItemError) as exc:
                log.warning("KV item %s failed its integrity check: %s", item_id, exc)
                corrupt.append(item_id)
                if drop_corrupt:
                    unlink: list[str] = []
                    with self._lock:
                        self._drop(item_id, unlink, reason=_reason(exc))
                    self._delete_files(unlink)
        self._report_drops()
        return IntegrityReport(ok=tuple(ok), corrupt=tuple(corrupt))
