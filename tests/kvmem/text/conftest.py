"""Fixtures for the plaintext store tests: a store with a deterministic embedder and clock, on each backend
(a SQLite temp file, and a fresh database of a real PostgreSQL server: tests/pg.py)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from kvmem.text import HashEmbedder, MemoryStore
from tests.pg import pg_server, pg_url  # noqa: F401  (fixtures)

BACKENDS = ["sqlite", "postgresql"]


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


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    return request.param


@pytest.fixture
def store_location(backend, tmp_path, request) -> str:
    """Where a test's store lives: a SQLite file in tmp_path, or a new PostgreSQL database's URL. Two
    stores opened on it share their memories (the cross-process / cross-replica case)."""
    if backend == "sqlite":
        return str(tmp_path / "memories.db")
    return request.getfixturevalue("pg_url")


@pytest.fixture
def new_location(backend, tmp_path, request):
    """Makes a new, empty place for a store on this test's backend: `new_location("a.db")` is a SQLite file
    of that name in tmp_path, or a new PostgreSQL database (tests that compare two separate stores)."""
    if backend == "sqlite":
        return lambda name: str(tmp_path / name)
    server = request.getfixturevalue("pg_server")
    request.getfixturevalue("pg_url")  # the server is up (a test before may have stopped it)
    prefix = f"n{id(request)}"
    return lambda name: server.create_database(f"{prefix}_{name.replace('.', '_')}")


def open_store(location: str, **kwargs) -> MemoryStore:
    """A store on `location` (a file path or a postgresql:// URL), with the test embedder by default."""
    kwargs.setdefault("embedder", HashEmbedder())
    return MemoryStore(location, **kwargs)


@pytest.fixture
def store(store_location, clock):
    s = open_store(store_location, clock=clock)
    yield s
    s.close()
