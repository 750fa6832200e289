"""Atomicity of each call, crash safety of a returned add, and use from many threads."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from kvmem.text import HashEmbedder, MemoryStore, TextStoreError

REPO = Path(__file__).resolve().parents[3]


def fail_second_insert(monkeypatch) -> list[str]:
    """Makes the store's second row insert raise OSError; returns the texts it was asked to insert."""
    real_insert = MemoryStore._insert
    calls: list[str] = []

    def flaky(conn, memory, vector):
        calls.append(memory.text)
        if len(calls) == 2:
            raise OSError("disk went away")
        return real_insert(conn, memory, vector)

    monkeypatch.setattr(MemoryStore, "_insert", staticmethod(flaky))
    return calls


def test_failure_mid_batch_writes_nothing(store, monkeypatch):
    store.add("alice", "before")
    calls = fail_second_insert(monkeypatch)
    with pytest.raises(OSError, match="disk went away"):
        store.add("alice", texts=["a", "b", "c"])
    monkeypatch.undo()
    assert calls == ["a", "b"]
    assert [m.text for m in store.list("alice").items] == ["before"]
    assert [h.memory.text for h in store.search("alice", "a b c before", mode="dense")] == ["before"]
    conn = store._conn()
    assert conn.execute(f"SELECT count(*) FROM {store._db.dialect.terms_table}").fetchone()[0] == 1
    assert conn.execute("SELECT count(*) FROM memory_vectors").fetchone()[0] == 1


def test_failure_mid_import_writes_nothing(store, tmp_path, monkeypatch):
    store.add("alice", texts=["a", "b", "c"])
    dump = tmp_path / "dump.jsonl"
    assert store.export_jsonl(dump) == 3
    other = MemoryStore(str(tmp_path / "other.sqlite"), embedder=HashEmbedder())
    other.add("bob", "before")
    calls = fail_second_insert(monkeypatch)
    with pytest.raises(OSError, match="disk went away"):
        other.import_jsonl(dump)
    monkeypatch.undo()
    assert len(calls) == 2 and other.list("alice").items == []
    assert [m.text for m in other.list("bob").items] == ["before"]
    assert other._conn().execute("SELECT count(*) FROM memory_vectors").fetchone()[0] == 1
    assert other.import_jsonl(dump) == 3  # and the same dump loads once the disk is back
    other.close()


_CHILD = """
import os, signal, sys
from kvmem.text import HashEmbedder, MemoryStore
store = MemoryStore(sys.argv[1], embedder=HashEmbedder())
for i in range(3):
    [m] = store.add("alice", f"durable {i}")
    print(m.id, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_returned_add_survives_a_kill(store_location):
    path = store_location
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, path],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=120,
        check=False,
    )
    assert proc.returncode == -9
    ids = proc.stdout.split()
    assert len(ids) == 3
    with MemoryStore(path, embedder=HashEmbedder()) as store:
        assert [m.text for m in store.memories_by_ids("alice", ids)] == [
            "durable 0",
            "durable 1",
            "durable 2",
        ]


def test_many_threads(store_location):
    with MemoryStore(store_location, embedder=HashEmbedder()) as store:
        errors = []

        def work(n):
            try:
                user = f"user{n % 3}"
                for i in range(20):
                    [m] = store.add(user, f"thread {n} item {i}")
                    assert store.get(user, m.id).text == f"thread {n} item {i}"
                    assert all(h.memory.user_id == user for h in store.search(user, "item", top_k=5))
            except (AssertionError, TextStoreError) as exc:  # collected and asserted below
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(n,)) for n in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        assert store.count_by_user() == {"user0": 40, "user1": 40, "user2": 40}
        assert len(store.search("user0", "thread item", mode="dense", top_k=100)) == 40
