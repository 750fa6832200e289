"""The tiered KV store's value types: its configuration, sizes, drop reports and integrity report."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvmem.kv.eviction import eviction_policy


@dataclass(frozen=True)
class KVStoreConfig:
    """Budgets in bytes; None = unlimited. On a CPU-only machine the device tier is CPU memory too.

    device_bytes=0: no device tier: the store keeps items in host RAM and on disk, and `get` hands out the
    host copy (moved to `device` only when that is not the CPU), never a second one; the engine's page pool
    is then the only device copy (serving/backends/transformers). pin_memory: host copies in page-locked
    memory when CUDA is available, so a copy into device pages can be non_blocking (ignored without CUDA).
    user_bytes: one user's cap in host RAM and, apart, on disk (`--kv-user-mb`, which also caps their pages in
    the engine's pool): past it, that user's own lowest-priority items leave the tier (host RAM: to disk
    only, or dropped when not on disk; disk: out of the store, reported as evicted), never another user's and
    never the item just put or read. Shared knowledge (owner "") has no cap. None: no cap.
    """

    directory: str
    device: str = "cpu"
    device_bytes: int | None = 2 << 30
    host_bytes: int | None = 4 << 30
    disk_bytes: int | None = None
    policy: str = "lru"
    verify_checksum: bool = True
    # the share of the time an item's write may keep its thread busy: below 1 it is written in synced pieces
    # with a pause after each (kvmem/kv/st_write.py), for a server whose streams share the cores with it
    write_duty: float = 1.0
    pin_memory: bool = False
    user_bytes: int | None = None

    def __post_init__(self) -> None:
        for name in ("device_bytes", "host_bytes", "disk_bytes", "user_bytes"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise ValueError(f"KVStoreConfig.{name} must be a non-negative int or None, got {value!r}")
        eviction_policy(self.policy)  # raises with the supported names
        if not 0 < self.write_duty <= 1:
            raise ValueError(f"KVStoreConfig.write_duty must be in (0, 1], got {self.write_duty!r}")
        torch.device(self.device)


@dataclass(frozen=True)
class TierSize:
    num_items: int
    num_tokens: int
    num_bytes: int


@dataclass(frozen=True)
class SizeInfo:
    device: TierSize
    host: TierSize
    disk: TierSize


@dataclass(frozen=True)
class DroppedItem:
    """An item the store dropped on its own. reason: "evicted" (over a budget), "corrupt",
    "fingerprint_mismatch" or "not_found" (indexed, but its files are gone)."""

    item_id: str
    user_id: str
    reason: str


@dataclass(frozen=True)
class IntegrityReport:
    ok: tuple[str, ...]
    corrupt: tuple[str, ...]
