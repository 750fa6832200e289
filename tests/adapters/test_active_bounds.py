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


def test_check_answers_as_get_would_without_recording(tmp_path):
    """A plan read (`check`) sees a newly activated version but leaves the worker's notice of the move
    (`peek` not current) for `get`, the read that acts on it."""
    from kvmem.adapters.manifest import CONFIG_FILE, WEIGHTS_FILE

    registry = AdapterRegistry(tmp_path / "adapters")
    active = ActiveAdapters(registry, lambda: "fp")
    assert active.get("alice") is None and active.peek("alice").current

    def save(d):
        (d / WEIGHTS_FILE).write_bytes(b"w")
        (d / CONFIG_FILE).write_text("{}")

    m = registry.write("alice", save, base_fingerprint="fp", facts=[], seed=0, passed=True)
    registry.activate("alice", m.version, "fp")
    assert active.check("alice").name == m.name
    assert active.peek("alice") == (None, False)  # still unrecorded: the worker will see the move
    assert active.get("alice").name == m.name and active.peek("alice").current


def test_a_store_failure_while_checking_a_versions_facts_serves_no_adapter_and_is_checked_again(tmp_path):
    """The fact check's store read raised through `get` (documented never to raise), and the scheduler's worker
    thread, which calls it between tasks, died: no block was built for anyone after it."""
    import sqlite3

    from kvmem.adapters.manifest import CONFIG_FILE, WEIGHTS_FILE

    registry = AdapterRegistry(tmp_path / "adapters")
    failures = [sqlite3.OperationalError("disk I/O error")]

    def current(user_id, facts):
        if failures:
            raise failures.pop()
        return None

    active = ActiveAdapters(registry, lambda: "fp", current)

    def save(d):
        (d / WEIGHTS_FILE).write_bytes(b"w")
        (d / CONFIG_FILE).write_text("{}")

    m = registry.write("alice", save, base_fingerprint="fp", facts=[], seed=0, passed=True)
    registry.activate("alice", m.version, "fp")
    assert active.get("alice") is None and not active.peek("alice").current  # not served, not recorded
    assert active.get("alice").name == m.name and active.peek("alice").current  # the store is back
