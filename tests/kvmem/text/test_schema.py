from __future__ import annotations

import sqlite3

import pytest

from kvmem.text import EmbedderMismatch, HashEmbedder, MemoryStore, TextStoreConfig, TextStoreError
from kvmem.text.schema import SCHEMA_VERSION


def test_schema_version_and_wal(store):
    conn = store._conn()
    assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 1
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert conn.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL


def test_reopen_keeps_data(tmp_path):
    with MemoryStore(tmp_path / "m.db", embedder=HashEmbedder()) as s:
        [m] = s.add("alice", "kept")
    with MemoryStore(tmp_path / "m.db", embedder=HashEmbedder()) as s:
        assert s.get("alice", m.id).text == "kept"


def test_newer_schema_is_refused(tmp_path):
    conn = sqlite3.connect(tmp_path / "m.db")
    conn.execute("PRAGMA user_version = 99")
    conn.close()
    with pytest.raises(TextStoreError, match="schema version 99, newer than this code's 1"):
        MemoryStore(tmp_path / "m.db", embedder=HashEmbedder())


def test_embedder_mismatch(tmp_path):
    with MemoryStore(tmp_path / "m.db", embedder=HashEmbedder(64)) as s:
        s.add("alice", "apples and pears")
    with pytest.raises(
        EmbedderMismatch,
        match="holds vectors of embedder 'hash-bow-64' \\(dim 64\\), opened with 'hash-bow-32'",
    ):
        MemoryStore(tmp_path / "m.db", embedder=HashEmbedder(32))
    config = TextStoreConfig(reembed_on_mismatch=True)
    with MemoryStore(tmp_path / "m.db", embedder=HashEmbedder(32), config=config) as s:
        assert [h.memory.text for h in s.search("alice", "pears", mode="dense")] == ["apples and pears"]
