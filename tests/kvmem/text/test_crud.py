from __future__ import annotations

import pytest

from kvmem.text import InvalidMemoryInput, MemoryNotFound, MemoryVersion


def test_add_text_keeps_every_field(store):
    [m] = store.add(
        "alice",
        "I adopted a beagle named Max",
        session_id="s1",
        agent_id="bot",
        tags=["pet", "dog"],
        metadata={"source": "chat", "n": 2},
        chat_time="2023-05-01T10:00:00+02:00",
    )
    assert (m.user_id, m.session_id, m.agent_id, m.role, m.text) == (
        "alice",
        "s1",
        "bot",
        None,
        "I adopted a beagle named Max",
    )
    assert m.chat_time == "2023-05-01T08:00:00.000000Z"
    assert m.created_at == m.updated_at == "2024-01-01T00:00:00.000000Z"
    assert (m.tags, m.metadata, m.state, m.version) == (
        ("pet", "dog"),
        {"source": "chat", "n": 2},
        "active",
        1,
    )
    assert store.get("alice", m.id) == m
    assert m.to_dict()["tags"] == ["pet", "dog"]


def test_chat_time_defaults_to_now(store):
    [m] = store.add("alice", "hello there")
    assert m.chat_time == m.created_at == "2024-01-01T00:00:00.000000Z"


def test_add_texts_and_messages(store):
    texts = store.add("alice", texts=["one", "two"], session_id="s")
    assert [m.text for m in texts] == ["one", "two"]
    msgs = store.add(
        "alice",
        messages=[
            {"role": "user", "content": "I live in Oslo", "chat_time": "2023-01-02T03:04:05Z"},
            {"role": "assistant", "content": "Oslo is lovely"},
        ],
        chat_time="2023-02-01T00:00:00Z",
    )
    assert [(m.role, m.text, m.chat_time) for m in msgs] == [
        ("user", "I live in Oslo", "2023-01-02T03:04:05.000000Z"),
        ("assistant", "Oslo is lovely", "2023-02-01T00:00:00.000000Z"),
    ]
    assert store.count("alice") == 4


def test_update_keeps_history(store, clock):
    [m] = store.add("alice", "I live in Oslo", tags=["home"])
    v2 = store.update("alice", m.id, text="I live in Bergen")
    v3 = store.update("alice", m.id, tags=["home", "moved"], metadata={"k": 1})
    assert (v2.version, v2.text, v2.updated_at) == (2, "I live in Bergen", "2024-01-01T00:00:01.000000Z")
    assert (v3.version, v3.text, v3.tags, v3.metadata) == (3, "I live in Bergen", ("home", "moved"), {"k": 1})
    assert store.get("alice", m.id) == v3
    assert store.history("alice", m.id) == [
        MemoryVersion(1, "I live in Oslo", ("home",), {}, "2024-01-01T00:00:00.000000Z"),
        MemoryVersion(2, "I live in Bergen", ("home",), {}, "2024-01-01T00:00:01.000000Z"),
    ]
    assert [h.memory.id for h in store.search("alice", "Bergen", mode="keyword")] == [m.id]
    assert store.search("alice", "Oslo", mode="keyword") == []


def test_update_without_change_makes_no_version(store):
    [m] = store.add("alice", "same", tags=["a"])
    assert store.update("alice", m.id, text="same", tags=["a"]) == m
    assert store.history("alice", m.id) == []


def test_archive_hides_from_search_and_default_list(store):
    [a, b] = store.add("alice", texts=["red apple", "green apple"])
    archived = store.update("alice", a.id, state="archived")
    assert archived.state == "archived"
    assert [h.memory.id for h in store.search("alice", "apple", mode="keyword")] == [b.id]
    assert [h.memory.id for h in store.search("alice", "apple", mode="dense")] == [b.id]
    assert [m.id for m in store.list("alice").items] == [b.id]
    assert [m.id for m in store.list("alice", state="archived").items] == [a.id]
    assert store.count("alice") == 2
    store.update("alice", a.id, state="active")
    assert {h.memory.id for h in store.search("alice", "apple", mode="dense")} == {a.id, b.id}


def test_delete_by_id_session_user(store):
    a = store.add("alice", texts=["a1", "a2"], session_id="s1")
    b = store.add("alice", texts=["b1"], session_id="s2")
    store.add("bob", texts=["x"], session_id="s1")
    assert store.delete("alice", a[0].id) == 1
    assert store.delete("alice", a[0].id) == 0
    assert store.delete("alice", "no-such-id") == 0
    with pytest.raises(MemoryNotFound):
        store.get("alice", a[0].id)
    assert store.delete_session("alice", "s1") == 1
    assert store.delete_session("alice", "s1") == 0
    assert [m.id for m in store.list("alice").items] == [b[0].id]
    assert store.delete_user("alice") == 1
    assert store.delete_user("alice") == 0
    assert store.count("alice") == 0
    assert store.count_by_user() == {"bob": 1}


def test_delete_erases_content_and_history(store):
    [m] = store.add("alice", "secret plan")
    store.update("alice", m.id, text="secret plan v2")
    store.delete("alice", m.id)
    conn = store._conn()
    assert conn.execute("SELECT text, tags, metadata, state FROM memories").fetchall() == [
        ("", "[]", '{"forgotten": true}', "deleted")  # no content; the fact was forgotten (deletes.FORGOTTEN)
    ]
    assert conn.execute("SELECT count(*) FROM memory_versions").fetchone()[0] == 0
    assert conn.execute(f"SELECT count(*) FROM {store._db.dialect.terms_table}").fetchone()[0] == 0
    assert conn.execute("SELECT count(*) FROM memory_vectors").fetchone()[0] == 0


def test_list_pages_newest_first(store):
    ids = [store.add("alice", f"memory {i}", session_id="s" if i % 2 else "t")[0].id for i in range(7)]
    page1 = store.list("alice", page=1, page_size=3)
    page3 = store.list("alice", page=3, page_size=3)
    assert ([m.id for m in page1.items], page1.total, page1.page, page1.page_size) == (ids[::-1][:3], 7, 1, 3)
    assert [m.id for m in page3.items] == [ids[0]]
    assert store.list("alice", page=4, page_size=3).items == []
    assert [m.id for m in store.list("alice", session_id="s").items] == [ids[5], ids[3], ids[1]]


def test_list_filters(store):
    a = store.add(
        "alice",
        "a",
        tags=["x", "y"],
        metadata={"lang": "en", "n": 1, "flag": True},
        chat_time="2024-03-01T00:00:00Z",
    )[0]
    b = store.add(
        "alice",
        "b",
        tags=["x"],
        metadata={"lang": "fr", "n": 1.0, "flag": 1},
        chat_time="2024-04-01T00:00:00Z",
    )[0]

    def ids(filters):
        return [m.id for m in store.list("alice", filters=filters).items]

    assert ids({"tags": ["x"]}) == [b.id, a.id]
    assert ids({"tags": ["x", "y"]}) == [a.id]
    assert ids({"metadata": {"lang": "fr"}}) == [b.id]
    assert ids({"metadata": {"n": 1}}) == [b.id, a.id]
    assert ids({"metadata": {"flag": True}}) == [a.id]
    assert ids({"metadata": {"flag": 1}}) == [b.id]
    assert ids({"metadata": {"missing": None}}) == []
    assert ids({"time_range": {"start": "2024-03-15T00:00:00Z"}}) == [b.id]
    assert ids({"time_range": {"end": "2024-03-01T00:00:00Z"}}) == [a.id]
    assert ids({"time_range": {"start": "2024-03-01", "end": "2024-04-01T00:00:00Z"}}) == [b.id, a.id]


def test_memories_by_ids_in_given_order(store):
    a, b, c = store.add("alice", texts=["a", "b", "c"])
    [other] = store.add("bob", "b's")
    assert [m.id for m in store.memories_by_ids("alice", [c.id, "nope", a.id, other.id, b.id])] == [
        c.id,
        a.id,
        b.id,
    ]
    assert store.memories_by_ids("alice", []) == []


def test_an_update_of_the_text_sets_the_slot_given_and_never_keeps_the_old_ones(store) -> None:
    [m] = store.add("u", texts=["I live in Lisbon."], slots=[("user|home_city", "lisbon")])
    tagged = store.update("u", m.id, tags=["home"])  # no new text: the slot stays
    assert (tagged.slot, tagged.slot_value) == ("user|home_city", "lisbon")
    same = store.update("u", m.id, text="I live in Lisbon.", slot=None)  # the same text: nothing changes
    assert same == tagged
    cat = store.update("u", m.id, text="I have a cat named Tom.", slot=("user|cat.name", "tom"))
    assert (cat.slot, cat.slot_value, cat.version) == ("user|cat.name", "tom", 3)
    assert store.get("u", m.id) == cat  # as stored
    plain = store.update("u", m.id, text="The weather was nice.")
    assert (store.get("u", m.id).slot, store.get("u", m.id).slot_value, plain.slot) == (None, None, None)
    with pytest.raises(InvalidMemoryInput, match="slot"):
        store.update("u", m.id, text="x", slot="user|x")
    assert store.get("u", m.id) == plain  # a refused update changes nothing
