from __future__ import annotations

import io
import json

import pytest

from kvmem.text import HashEmbedder, InvalidMemoryInput, MemoryStore


def _fill(store):
    a = store.add(
        "alice",
        "I live in Oslo",
        session_id="s1",
        agent_id="bot",
        tags=["home"],
        metadata={"n": 1},
        chat_time="2023-05-01T10:00:00Z",
    )[0]
    store.update("alice", a.id, text="I live in Bergen")
    store.add(
        "alice", messages=[{"role": "user", "content": "héllo ☃"}, {"role": "assistant", "content": "hi"}]
    )
    b = store.add("bob", "bob's note")[0]
    store.update("bob", b.id, state="archived")
    gone = store.add("bob", "deleted note")[0]
    store.delete("bob", gone.id)
    return a


def _snapshot(store, users):
    out = {}
    for user in users:
        memories = store.list(user, page_size=100, state="all").items
        out[user] = [(m, store.history(user, m.id)) for m in memories]
    return out


def test_round_trip_is_identical(store, tmp_path):
    _fill(store)
    path = tmp_path / "dump.jsonl"
    assert store.export_jsonl(path) == 4
    with MemoryStore(tmp_path / "copy.db", embedder=HashEmbedder()) as copy:
        assert copy.import_jsonl(path) == 4
        assert _snapshot(copy, ["alice", "bob"]) == _snapshot(store, ["alice", "bob"])
        again = io.StringIO()
        copy.export_jsonl(again)
        assert again.getvalue() == path.read_text(encoding="utf-8")
        vectors = (
            copy._conn()
            .execute(
                "SELECT m.id, v.vec FROM memory_vectors v JOIN memories m ON m.rowid = v.rowid ORDER BY m.id"
            )
            .fetchall()
        )
        original = (
            store._conn()
            .execute(
                "SELECT m.id, v.vec FROM memory_vectors v JOIN memories m ON m.rowid = v.rowid ORDER BY m.id"
            )
            .fetchall()
        )
        assert vectors == original
        assert [h.memory.text for h in copy.search("alice", "Bergen", mode="keyword")] == ["I live in Bergen"]


def test_export_one_user(store):
    _fill(store)
    buffer = io.StringIO()
    assert store.export_jsonl(buffer, user_id="bob") == 1
    [line] = buffer.getvalue().splitlines()
    record = json.loads(line)
    assert (record["user_id"], record["text"], record["state"]) == ("bob", "bob's note", "archived")
    assert record["embedding"]["model"] == "hash-bow-64" and record["embedding"]["dim"] == 64


def test_import_other_embedder_re_embeds(store, tmp_path):
    _fill(store)
    path = tmp_path / "dump.jsonl"
    store.export_jsonl(path)
    with MemoryStore(tmp_path / "copy.db", embedder=HashEmbedder(dim=32)) as copy:
        assert copy.import_jsonl(path) == 4
        assert [h.memory.text for h in copy.search("alice", "Bergen", mode="dense", top_k=1)] == [
            "I live in Bergen"
        ]
        assert len(copy._conn().execute("SELECT vec FROM memory_vectors LIMIT 1").fetchone()[0]) == 32 * 4


def test_import_is_all_or_nothing(store, tmp_path):
    _fill(store)
    lines = io.StringIO()
    store.export_jsonl(lines)
    good = lines.getvalue().splitlines()
    bad = json.loads(good[1])
    bad["chat_time"] = "soon"
    with MemoryStore(tmp_path / "copy.db", embedder=HashEmbedder()) as copy:
        with pytest.raises(InvalidMemoryInput, match="line 2: chat_time is not an ISO 8601 time"):
            copy.import_jsonl(io.StringIO("\n".join([good[0], json.dumps(bad), good[2]])))
        with pytest.raises(InvalidMemoryInput, match="line 3: id .* appears twice"):
            copy.import_jsonl(io.StringIO("\n".join([good[0], good[1], good[0]])))
        with pytest.raises(InvalidMemoryInput, match="line 1: not JSON"):
            copy.import_jsonl(io.StringIO("{oops"))
        with pytest.raises(InvalidMemoryInput, match=r"missing field\(s\) \['history'\]"):
            record = json.loads(good[0])
            del record["history"]
            copy.import_jsonl(io.StringIO(json.dumps(record)))
        assert copy.count_by_user() == {}


def test_import_conflicts(store, tmp_path):
    _fill(store)
    dump = io.StringIO()
    store.export_jsonl(dump)
    with pytest.raises(InvalidMemoryInput, match="4 id\\(s\\) already in the store"):
        store.import_jsonl(io.StringIO(dump.getvalue()))
    assert store.import_jsonl(io.StringIO(dump.getvalue()), on_conflict="skip") == 0
    assert store.count_by_user() == {"alice": 3, "bob": 1}


def test_a_superseded_memory_dumps_its_stored_state_and_loads_back_superseded(store, tmp_path):
    """The API shows a superseded memory's state as "superseded" (Memory.to_dict); a dump keeps the stored one,
    which its import accepts, and the copy is superseded as the original was."""
    old, new = store.add("alice", texts=["I live in Oslo", "I live in Bergen"])
    store.supersede("alice", old.id, new.id)
    assert store.get("alice", old.id).to_dict()["state"] == "superseded"
    path = tmp_path / "dump.jsonl"
    assert store.export_jsonl(path) == 2
    assert sorted(json.loads(line)["state"] for line in path.read_text().splitlines()) == ["active", "active"]
    with MemoryStore(tmp_path / "copy.db", embedder=HashEmbedder()) as copy:
        assert copy.import_jsonl(path) == 2
        assert copy.get("alice", old.id) == store.get("alice", old.id)
        assert [m.id for m in copy.list("alice").items] == [new.id]
