from __future__ import annotations

import sqlite3

import pytest

from kvmem.text import EmbedderMismatch, HashEmbedder, MemoryStore, TextStoreConfig, TextStoreError
from kvmem.text.db.schema import SCHEMA_VERSION


@pytest.mark.parametrize("backend", ["sqlite"])  # PRAGMAs: PostgreSQL's version is test_postgres.py's
def test_schema_version_and_wal(store):
    conn = store._conn()
    assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert conn.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL


def test_reopen_keeps_data(store_location):
    with MemoryStore(store_location, embedder=HashEmbedder()) as s:
        [m] = s.add("alice", "kept")
    with MemoryStore(store_location, embedder=HashEmbedder()) as s:
        assert s.get("alice", m.id).text == "kept"


def test_newer_schema_is_refused(tmp_path):
    conn = sqlite3.connect(tmp_path / "m.db")
    conn.execute("PRAGMA user_version = 99")
    conn.close()
    with pytest.raises(TextStoreError, match=f"schema version 99, newer than this code's {SCHEMA_VERSION}"):
        MemoryStore(tmp_path / "m.db", embedder=HashEmbedder())


def test_embedder_mismatch(store_location):
    with MemoryStore(store_location, embedder=HashEmbedder(64)) as s:
        s.add("alice", "apples and pears")
    with pytest.raises(
        EmbedderMismatch,
        match="holds vectors of embedder 'hash-bow-64' \\(dim 64\\), opened with 'hash-bow-32'",
    ):
        MemoryStore(store_location, embedder=HashEmbedder(32))
    config = TextStoreConfig(reembed_on_mismatch=True)
    with MemoryStore(store_location, embedder=HashEmbedder(32), config=config) as s:
        assert [h.memory.text for h in s.search("alice", "pears", mode="dense")] == ["apples and pears"]


def test_a_file_written_by_the_previous_code_opens_as_is(tmp_path):
    """data/v1_main_119c6d6.db was written by main at 119c6d6 (FTS5's file-wide bm25): alice has 4 turns,
    bob 30 'apple' turns. It opens (migrated to schema 3: new columns, the log table, the erased generation) with nothing re-indexed,
    and alice's ranking is her own."""
    import shutil
    from pathlib import Path

    path = tmp_path / "memories.db"
    shutil.copy(Path(__file__).parent / "data" / "v1_main_119c6d6.db", path)
    with MemoryStore(path, embedder=HashEmbedder()) as s:
        assert s._conn().execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        assert s.count_by_user() == {"alice": 4, "bob": 30}
        texts = [h.memory.text for h in s.search("alice", "apple banana", mode="keyword")]
        # the old code ranked the bananas first (bob made 'apple' common in the whole file); within
        # alice's rows 'apple' is as rare as 'banana', and the shorter apple turn leads
        assert texts == ["apple tart", "banana bread", "banana plum jam", "we baked an apple pie"]
        hits = s.search("alice", "what did we bake on 5 Jan 2024")
        assert hits[0].memory.text == "we baked an apple pie"
        [new] = s.add("alice", "apple crumble", session_id="s1")
        assert s.search("alice", "crumble", mode="keyword")[0].memory.id == new.id
