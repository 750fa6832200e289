"""Eviction strategies for one tier of the KV store: each is a tiny class returning a priority.

The store evicts the entry with the *lowest* priority first. Strategies are chosen by name; the clock is
whatever the store records (monotonic access counter), so order is deterministic in tests.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EntryStats:
    """What a strategy may look at. `last_access` is a store-wide monotonic counter, not wall time."""

    num_bytes: int
    num_tokens: int
    hits: int
    last_access: int
    inserted: int


class EvictionPolicy:
    name = "base"

    def priority(self, stats: EntryStats) -> tuple:
        raise NotImplementedError


class LRUPolicy(EvictionPolicy):
    """Least recently used goes first."""

    name = "lru"

    def priority(self, stats: EntryStats) -> tuple:
        return (stats.last_access,)


class LFUPolicy(EvictionPolicy):
    """Fewest hits goes first; ties broken by recency."""

    name = "lfu"

    def priority(self, stats: EntryStats) -> tuple:
        return (stats.hits, stats.last_access)


class FIFOPolicy(EvictionPolicy):
    """Oldest insertion goes first."""

    name = "fifo"

    def priority(self, stats: EntryStats) -> tuple:
        return (stats.inserted,)


class SizeAwareLRUPolicy(EvictionPolicy):
    """Among equally recent-ish entries prefer evicting big ones: recency bucketed, then size descending."""

    name = "size_lru"

    def priority(self, stats: EntryStats) -> tuple:
        return (stats.last_access // 8, -stats.num_bytes, stats.last_access)


_POLICIES: dict[str, type[EvictionPolicy]] = {
    p.name: p for p in (LRUPolicy, LFUPolicy, FIFOPolicy, SizeAwareLRUPolicy)
}


def eviction_policy(name: str) -> EvictionPolicy:
    if name not in _POLICIES:
        raise ValueError(f"unknown eviction policy {name!r}; supported: {', '.join(sorted(_POLICIES))}")
    return _POLICIES[name]()
