"""The scheduler tests' shared fixture: a store over the hash embedder at a fixed time (formation's tests)."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest

from kvmem.text import HashEmbedder, MemoryStore


@pytest.fixture
def store(tmp_path):
    moment = datetime(2026, 11, 26, 12, 0, tzinfo=timezone.utc)
    s = MemoryStore(tmp_path / "m.sqlite", embedder=HashEmbedder(), clock=lambda: moment)
    yield s
    s.close()
