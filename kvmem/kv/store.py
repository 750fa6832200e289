"""The tiered KV store: device -> host RAM -> disk, each tier with a byte budget.

Owns where each item lives and moving items between tiers (write-through to disk on put; promotion to
the device tier on get, none without one: device_bytes=0; demotion device -> host -> dropped-from-RAM; disk
overflow deletes files). Which
item leaves a tier is the pluggable eviction policy's call. Items the store drops on its own (evicted,
corrupt, mismatched, files gone) are reported to drop listeners; `forget` is the delete cascade. Thread-safe:
one lock guards the indexes; disk loads, file deletes, directory scans and listener calls run outside it.
Items are immutable, so readers share them freely. The index (scan, adopt, lookups, sizes) is mixed in from
store_index.py, the disk reads (a load's read, verification, the integrity check) from store_reads.py. Knows
nothing of memories' text, plans or HTTP.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from kvmem.errors import KVItemCorrupt, KVItemNotFound, StorageError
from kvmem.kv.cascade import disk_metas, matcher
from kvmem.kv.eviction import EntryStats, eviction_policy
from kvmem.kv.fingerprint import Fingerprint
from kvmem.kv.io import delete_item_files, save_item
from kvmem.kv.item import KVItem, KVItemMeta
from kvmem.kv.st_write import paced
from kvmem.kv.store_index import StoreIndex
from kvmem.kv.store_reads import StoreReads
from kvmem.kv.store_types import DroppedItem, IntegrityReport, KVStoreConfig, SizeInfo, TierSize

log = logging.getLogger(__name__)

TIERS = ("device", "host", "disk")
__all__ = ["DroppedItem", "IntegrityReport", "KVStoreConfig", "SizeInfo", "TierSize", "TieredKVStore"]


def _own_part(item: KVItem) -> KVItem:
    """What a tier holds of `item`: a child's own tokens' K/V only (its own tensor, not a view that would keep
    a full-length build alive), no parent attached."""
    k = item.meta.parent_tokens - item.own_start
    if item.meta.parent_id is None or k == 0:
        return item.bare()
    return KVItem(item.meta, item.token_ids, item.kv[:, :, :, k:].clone())


def _pinned(item: KVItem) -> KVItem:
    """`item` (on the CPU) in page-locked memory, so a copy to a GPU can overlap (non_blocking)."""
    if item.kv.device.type != "cpu" or item.kv.is_pinned():
        return item
    return KVItem(item.meta, item.token_ids, item.kv.pin_memory(), item.parent)


class TieredKVStore(StoreReads, StoreIndex):
    """get / put / remove / contains / size_info / check_integrity over three tiers.

    `get` raises KVItemNotFound, KVItemCorrupt or FingerprintMismatch (all KVItemError): callers fall back
    to plaintext. A corrupt, mismatched or vanished item is removed from the index (and its files deleted) so
    the next build replaces it. Every item the store drops on its own (that, and eviction over the disk
    budget or of a RAM-only item) is reported to the callbacks given to `subscribe_drops`, after the lock is
    released, on the thread whose call dropped it; `remove`/`forget` report nothing (their caller knows).
    """

    def __init__(self, config: KVStoreConfig, fingerprint: Fingerprint):
        self.config = config
        self.fingerprint = fingerprint
        self.directory = Path(config.directory)
        self._policy = eviction_policy(config.policy)
        self._lock = threading.RLock()
        self._clock = itertools.count(1)
        self._resident: dict[str, dict[str, KVItem]] = {"device": {}, "host": {}}
        self._on_disk: dict[str, KVItemMeta] = {}
        self._stats: dict[str, EntryStats] = {}
        self.num_hits = {"device": 0, "host": 0, "disk": 0, "miss": 0}
        self.disk_loads = {"loads": 0, "bytes": 0, "seconds": 0.0}  # item files read by `get`, verified
        self._dropped: list[DroppedItem] = []  # dropped under the lock, reported once it is released
        self._listeners: list[Callable[[DroppedItem], None]] = []
        # a test seam: called with the item id on the reading thread just before an item's files are read
        self.before_disk_read: Callable[[str], None] | None = None
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StorageError(f"KV store directory {self.directory} cannot be created: {exc}") from exc
        if not os.access(self.directory, os.W_OK):
            raise StorageError(f"KV store directory {self.directory} is not writable")
        self._scanned_at: int | None = None  # the directory's mtime at the last rescan
        self._scan()

    def _tier_bytes(self, tier: str) -> int:
        if tier == "disk":
            return sum(m.stored_bytes for m in self._on_disk.values())
        return sum(i.meta.stored_bytes for i in self._resident[tier].values())

    def _budget(self, tier: str) -> int | None:
        return getattr(self.config, f"{tier}_bytes")

    @property
    def has_device_tier(self) -> bool:
        """False with device_bytes=0: items live in host RAM and on disk only (KVStoreConfig)."""
        return self.config.device_bytes != 0

    def _host_copy(self, item: KVItem) -> KVItem:
        """What the host tier holds of `item`: on the CPU, page-locked when asked and CUDA is there."""
        item = item.to("cpu")
        if self.config.pin_memory and torch.cuda.is_available():
            item = _pinned(item)
        return item

    def _victim(self, ids: Iterable[str], keep: str | None) -> str | None:
        candidates = [i for i in ids if i != keep]
        if not candidates:
            return None
        return min(candidates, key=lambda i: self._policy.priority(self._stats[i]))

    # -- eviction --------------------------------------------------------------------------------------
    def _plan_demotions(self, keep: str | None) -> list[tuple[str, KVItem]]:
        """The device-tier items to demote to host RAM, in eviction order, until the tier is within its budget
        (never `keep`). Nothing moves yet: the device-to-host copies are made by `_settle`, outside the lock.
        Lock held."""
        budget = self._budget("device")
        leaving: dict[str, KVItem] = {}
        while budget is not None:
            over = self._tier_bytes("device") - sum(i.meta.stored_bytes for i in leaving.values())
            victim = self._victim((i for i in self._resident["device"] if i not in leaving), keep)
            if over <= budget or victim is None:
                break
            leaving[victim] = self._resident["device"][victim]
        return list(leaving.items())

    def _evict_lower(self, unlink: list[str], keep: str | None, owner: KVItem | None = None) -> None:
        """`owner`'s user over their cap (`user_bytes`) in host RAM or on disk loses their own other items first
        (`owner`, the item just put or read, stays); then host RAM over its budget: items leave RAM (a RAM-only
        one is dropped and reported); disk over its budget: items leave the index, their ids added to `unlink`
        (files deleted once the lock is released). No copies. Lock held."""
        if owner is not None:
            self._cap_user(owner.meta.user_id, unlink, owner.item_id)
        budget = self._budget("host")
        while budget is not None and self._tier_bytes("host") > budget:
            victim = self._victim(self._resident["host"], keep)
            if victim is None:
                break
            self._leave_host(victim)
        budget = self._budget("disk")
        while budget is not None and self._tier_bytes("disk") > budget:
            victim = self._victim(self._on_disk, keep)
            if victim is None:
                break
            self._drop(victim, unlink, reason="evicted")

    def _leave_host(self, item_id: str) -> None:
        """Out of host RAM; a RAM-only item is dropped and reported. Lock held."""
        item = self._resident["host"].pop(item_id)
        if item_id not in self._on_disk:
            self._stats.pop(item_id, None)
            self._dropped.append(DroppedItem(item_id, item.meta.user_id, "evicted"))
        log.debug("evicted KV item %s from host", item_id)

    def _user_bytes(self, tier: str, user: str) -> int:
        if tier == "disk":
            return sum(m.stored_bytes for m in self._on_disk.values() if m.user_id == user)
        return sum(i.meta.stored_bytes for i in self._resident[tier].values() if i.meta.user_id == user)

    def _cap_user(self, user: str, unlink: list[str], keep: str | None) -> None:
        """One user's items within `user_bytes` in host RAM and on disk: their own lowest-priority items leave
        (never `keep`, never another user's). Shared knowledge (owner "") is not capped. Lock held."""
        cap = self.config.user_bytes
        if cap is None or not user:
            return
        while self._user_bytes("host", user) > cap:
            host = self._resident["host"]
            victim = self._victim((i for i, it in host.items() if it.meta.user_id == user), keep)
            if victim is None:
                break
            self._leave_host(victim)
        while self._user_bytes("disk", user) > cap:
            victim = self._victim((i for i, m in self._on_disk.items() if m.user_id == user), keep)
            if victim is None:
                break
            self._drop(victim, unlink, reason="evicted")
            log.info(
                "KV item %s of user %r left the store: over the user's cap of %d bytes", victim, user, cap
            )

    def _settle(self, demotions: list[tuple[str, KVItem]], unlink: list[str], keep: str | None) -> None:
        """After a put or a promotion, with the lock released: copy the planned demotions to host RAM (device-to-
        host copies, the slow part, hold no lock), move each under the lock unless it was removed or replaced
        meanwhile, enforce the host and disk budgets, and plan again while the device tier is over budget; then
        delete the files of the items dropped and report the drops. The caller's tiers are settled when it
        returns."""
        while demotions:
            copies = [(item_id, item, item.to("cpu")) for item_id, item in demotions]
            moved = False
            with self._lock:
                for item_id, item, host_item in copies:
                    if self._resident["device"].get(item_id) is item:
                        del self._resident["device"][item_id]
                        self._resident["host"][item_id] = host_item
                        moved = True
                        log.debug("evicted KV item %s from device", item_id)
                self._evict_lower(unlink, keep)
                demotions = self._plan_demotions(keep) if moved else []
        self._delete_files(unlink)
        self._report_drops()

    def _drop(self, item_id: str, unlink: list[str], *, reason: str | None = None) -> bool:
        """Out of every tier and the index; its id is added to `unlink`: the caller deletes its files once the
        lock is released (`_delete_files`), before its own call returns. With a reason, the drop is reported to
        the listeners. Returns whether it was indexed. Lock held."""
        user_id = self._user_of(item_id)
        existed = False
        for tier in ("device", "host"):
            existed |= self._resident[tier].pop(item_id, None) is not None
        existed |= self._on_disk.pop(item_id, None) is not None
        self._stats.pop(item_id, None)
        unlink.append(item_id)
        if reason is not None and user_id is not None:
            self._dropped.append(DroppedItem(item_id, user_id, reason))
        return existed

    def _delete_files(self, item_ids: Iterable[str]) -> bool:
        """Delete the files of items already out of the index, outside the lock: readers and writers of other
        items do not wait on the unlinks (a load of a dropped item under way is refused by `get`'s index check).
        Returns whether any file was there."""
        existed = False
        for item_id in item_ids:
            existed |= delete_item_files(self.directory, item_id)
        return existed

    def _user_of(self, item_id: str) -> str | None:
        for tier in ("device", "host"):
            if item_id in self._resident[tier]:
                return self._resident[tier][item_id].meta.user_id
        meta = self._on_disk.get(item_id)
        return None if meta is None else meta.user_id

    # -- drop listeners ----------------------------------------------------------------------------------
    def subscribe_drops(self, callback: Callable[[DroppedItem], None]) -> Callable[[], None]:
        """Call `callback(dropped)` for every item the store drops on its own; returns an unsubscribe."""
        with self._lock:
            self._listeners.append(callback)

        def unsubscribe() -> None:
            with self._lock:
                if callback in self._listeners:
                    self._listeners.remove(callback)

        return unsubscribe

    def _report_drops(self) -> None:
        """Hand the drops recorded under the lock to the listeners. Called with the lock released."""
        with self._lock:
            dropped, self._dropped = self._dropped, []
            listeners = list(self._listeners)
        for d in dropped:
            log.info("KV item %s of user %r dropped (%s)", d.item_id, d.user_id, d.reason)
            for callback in listeners:
                try:
                    callback(d)
                except Exception:  # noqa: BLE001 - a listener must not undo the store's work; logged
                    log.exception("KV drop listener %r failed on %s", callback, d)

    # -- public API ------------------------------------------------------------------------------------
    def put(self, item: KVItem, *, persist: bool = True) -> str:
        """Store an item (write-through to disk unless persist=False) and make it device-resident.

        Raises StorageError if the disk write fails; then nothing already stored has changed.
        """
        diff = self.fingerprint.mismatches(item.meta.fingerprint.base)  # items under adapters too
        if diff:
            raise ValueError(f"item {item.item_id} does not match this store's model ({', '.join(diff)})")
        if item.meta.parent_id is not None:
            self._check_parent(item)
        if persist:
            save_item(item, self.directory, paced(self.config.write_duty))
        own = _own_part(item)  # a tier holds a child's own K/V only
        unlink: list[str] = []
        if not self.has_device_tier:  # host RAM is the fastest tier: no device copy
            host_item = self._host_copy(own)
            with self._lock:
                if persist:
                    self._on_disk[item.item_id] = item.meta
                self._stats.setdefault(item.item_id, self._new_stats(item.meta))
                self._resident["host"][item.item_id] = host_item
                self._evict_lower(unlink, item.item_id if self._fits("host", item) else None, item)
            self._settle([], unlink, None)
            return item.item_id
        device_item = own.to(self.config.device)
        with self._lock:
            if persist:
                self._on_disk[item.item_id] = item.meta
            self._stats.setdefault(item.item_id, self._new_stats(item.meta))
            self._resident["host"].pop(item.item_id, None)
            self._resident["device"][item.item_id] = device_item
            keep = item.item_id if self._fits("device", item) else None
            demotions = self._plan_demotions(keep)
            self._evict_lower(unlink, keep, item)
        self._settle(demotions, unlink, keep)
        return item.item_id

    def _fits(self, tier: str, item: KVItem) -> bool:
        budget = self._budget(tier)
        return budget is None or item.meta.stored_bytes <= budget

    def get(self, item_id: str) -> KVItem:
        """The item on the store's device, promoted to the device tier (without one: the host tier's copy,
        a disk item read into the host tier)."""
        with self._lock:
            item = self._resident["device"].get(item_id)
            if item is not None:
                self._touch(item_id)
                self.num_hits["device"] += 1
        if item is not None:
            return self._attach(item) if item.meta.parent_id is not None else item
        with self._lock:
            host_item = self._resident["host"].get(item_id)
            indexed = self._on_disk.get(item_id)  # a put of the same id meanwhile indexes another meta
            if host_item is None and item_id not in self._on_disk:
                self.num_hits["miss"] += 1
                raise KVItemNotFound(f"KV item {item_id} is not stored")
        if host_item is not None:
            item, source = (host_item.to(self.config.device) if self.has_device_tier else host_item), "host"
        else:
            item, source = self._read_from_disk(item_id, indexed), "disk"
        if not self.has_device_tier:
            return self._into_host(item_id, item, source)
        unlink: list[str] = []
        demotions: list[tuple[str, KVItem]] = []
        keep = item_id if self._fits("device", item) else None
        with self._lock:
            current = self._resident["device"].get(item_id)
            if current is None and item_id not in self._stats:  # removed while we were loading
                raise KVItemNotFound(f"KV item {item_id} was removed")
            if current is None:
                self._resident["host"].pop(item_id, None)
                self._resident["device"][item_id] = item
                self._touch(item_id)
                self.num_hits[source] += 1
                demotions = self._plan_demotions(keep)
                self._evict_lower(unlink, keep, item)
            else:  # another reader promoted it meanwhile
                item = current
        self._settle(demotions, unlink, keep)
        return self._attach(item) if item.meta.parent_id is not None else item

    def peek(self, item_id: str) -> KVItem:
        """The item (its parent attached) without moving it between tiers: the resident copy, else a read of
        its file that no tier keeps (a block about to be deleted is read once to cut a prefix from it, and must
        not push other users' blocks out of RAM). Raises KVItemError as `get`."""
        with self._lock:
            item = self._resident["device"].get(item_id) or self._resident["host"].get(item_id)
            indexed = self._on_disk.get(item_id)
            if item is None and indexed is None:
                raise KVItemNotFound(f"KV item {item_id} is not stored")
        if item is None:
            item = self._read_from_disk(item_id, indexed)
        return self._attach(item, self.peek) if item.meta.parent_id is not None else item

    def _into_host(self, item_id: str, item: KVItem, source: str) -> KVItem:
        """`get` without a device tier: the item enters (or stays in) the host tier; that copy is handed out."""
        unlink: list[str] = []
        with self._lock:
            if item_id not in self._stats:  # removed while we were loading
                raise KVItemNotFound(f"KV item {item_id} was removed")
            item = self._resident["host"].setdefault(item_id, item)  # another reader's, if it loaded it too
            self._touch(item_id)
            self.num_hits[source] += 1
            self._evict_lower(unlink, item_id if self._fits("host", item) else None, item)
        self._settle([], unlink, None)
        item = item.to(self.config.device)
        return self._attach(item) if item.meta.parent_id is not None else item

    def _attach(self, own: KVItem, read: Callable[[str], KVItem] | None = None) -> KVItem:
        """The child with its parent attached (the parent resident once, shared by every child: views, not a
        joined copy), read by `get` (or `read`). Raises KVItemNotFound etc. when the parent is unusable: the child
        is too until it is back."""
        parent = (read or self.get)(own.meta.parent_id)
        if parent.num_tokens != own.meta.parent_tokens:
            raise KVItemCorrupt(f"KV item {own.item_id}: its parent {parent.item_id} holds other tokens")
        return KVItem(own.meta, own.token_ids, own.kv, parent)

    def _check_parent(self, item: KVItem) -> None:
        """A child's parent is stored and holds the child's first tokens (once, when the child is put or loaded
        from disk: the parent's id is a content address, so it holds those tokens as long as it is indexed)."""
        parent = item.parent if item.parent is not None else self.get(item.meta.parent_id)
        if parent.token_ids != item.token_ids[: item.meta.parent_tokens]:
            raise KVItemCorrupt(f"KV item {item.item_id}: its parent {parent.item_id} holds other tokens")

    def on_device(self, item_id: str) -> bool:
        """The item, and its parent if it has one, are in the device tier (`get` reads no file). A dict read."""
        with self._lock:
            item = self._resident["device"].get(item_id)
            parent = None if item is None else item.meta.parent_id
            return item is not None and (parent is None or parent in self._resident["device"])

    def remove(self, item_id: str) -> bool:
        """Remove from every tier and delete its files (once out of the index, outside the lock). Returns
        whether anything was there."""
        unlink: list[str] = []
        with self._lock:
            indexed = self._drop(item_id, unlink)
        return self._delete_files(unlink) or indexed

    def _all_metas(self) -> dict[str, KVItemMeta]:
        """Every item's metadata, indexed or only on disk (written after the start-up scan by another process:
        `kvmem build`, a peer server). The directory scan and the manifest reads run outside the lock; the
        index is read under it after the scan, so an item this process indexed meanwhile is in it."""
        with self._lock:
            indexed = self._indexed_metas()
        on_disk = disk_metas(self.directory, skip=indexed)
        with self._lock:
            return {**on_disk, **self._indexed_metas()}

    def items_containing(self, user_id: str, memory_id: str) -> list[str]:
        """Ids of this user's items built from `memory_id`, indexed or only on disk (the delete cascade)."""
        metas = self._all_metas()
        return sorted(i for i, m in metas.items() if m.user_id == user_id and memory_id in m.memory_ids)

    def forget(
        self, user_id: str, memory_ids: Iterable[str] | None = None, adapters: Iterable[str] = ()
    ) -> list[str]:
        """The delete cascade: every item of `user_id` built from any of `memory_ids` (None: all of the user's
        items) or under any of the LoRA `adapters` (served names), indexed or only on disk, leaves the index and
        has its files deleted before this returns, so `get` refuses it (a load already under way is refused
        too). Returns the ids, sorted. An item a request already holds may finish serving that request
        (immutability). Reports nothing to drop listeners."""
        match = matcher(user_id, memory_ids, adapters)
        ids = sorted(i for i, m in self._all_metas().items() if match(m))
        unlink: list[str] = []
        with self._lock:
            for item_id in ids:
                self._drop(item_id, unlink)
        self._delete_files(unlink)  # before this returns, outside the lock
        if ids:
            log.info("forgot %d KV item(s) of user %r", len(ids), user_id)
        return ids

    def remove_user(self, user_id: str) -> int:
        """Forget every item of `user_id`; returns how many there were."""
        return len(self.forget(user_id))
