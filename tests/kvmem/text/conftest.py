"""Fixtures for the plaintext store tests: a store on a temp file with a deterministic embedder and clock."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from kvmem.text import HashEmbedder, MemoryStore


class StepClock:
    """Returns 2024-01-01T00:00:00Z, then one second later on every call."""

    def __init__(self) -> None:
        self.now = datetime(2024, 1, 1, tzinfo=timezone.utc)

    def __call__(self) -> datetime:
        current = self.now
        self.now += timedelta(seconds=1)
        return current


@pytest.fixture
def clock() -> StepClock:
    return StepClock()


@pytest.fixture
def store(tmp_path, clock):
    s = MemoryStore(tmp_path / "memories.db", embedder=HashEmbedder(), clock=clock)
    yield s
    s.close()
