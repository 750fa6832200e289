"""ActiveAdapters keeps at most `max_users` users' served adapters and version checks (LRU)."""

from __future__ import annotations

import pytest

from kvmem.adapters import AdapterRegistry
from kvmem.adapters.active import ActiveAdapters


def test_the_served_adapter_cache_is_lru_bounded(tmp_path):
    active = ActiveAdapters(AdapterRegistry(tmp_path / "adapters"), lambda: "fp-1", max_users=3)
    for i in range(100_000 // 1000):  # 100 users' reads
        assert active.get(f"user-{i}") is None
    assert list(active._cache) == ["user-97", "user-98", "user-99"]
    active.get("user-97")  # read again: now the most recent
    active.get("user-new")
    assert list(active._cache) == ["user-99", "user-97", "user-new"]
    assert active.peek("user-0").manifest is None and active.peek("user-0").current  # no pointer: current
    with pytest.raises(ValueError, match="max_users must be >= 1, got 0"):
        ActiveAdapters(AdapterRegistry(tmp_path / "a2"), lambda: None, max_users=0)
