"""The conversation log: schema V2 migration, appending and paging turns, the formation queue (pending, failed,
dead, requeued, counted), and deletes cascading to the log."""

from __future__ import annotations

import io
import json
import sqlite3

import pytest

from kvmem.text import HashEmbedder, InvalidMemoryInput, MemoryStore
from kvmem.text.db.schema import MIGRATIONS, SCHEMA_VERSION
from kvmem.text.records import FormationCounts, FormedMemory, Turn


def test_a_v1_file_migrates_to_v2(tmp_path):
    path = tmp_path / "v1.db"
    conn = sqlite3.connect(path)
    for statement in MIGRATIONS[0].split(";"):
        if statement.strip():
            conn.execute(statement)
    conn.execute("PRAGMA user_version = 1")
    conn.execute(
        "INSERT INTO memories (id, user_id, session_id, agent_id, role, text, created_at, chat_time, updated_at, "
        "tags, metadata, state, version) VALUES ('m1', 'alice', 's1', NULL, 'user', 'I live in Oslo', "
        "'2024-01-02T00:00:00.000000Z', '2023-12-31T10:00:00.000000Z', '2024-01-02T00:00:00.000000Z', '[]', "
        "'{}', 'active', 1)"
    )
    conn.commit()
    conn.close()
    with MemoryStore(path, embedder=HashEmbedder()) as store:
        assert store._conn().execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION  # the latest
        m = store.get("alice", "m1")
        assert (m.valid_from, m.valid_to, m.superseded_by) == ("2023-12-31T10:00:00.000000Z", None, None)
        assert (m.source, m.source_turn_ids, m.slot, m.slot_value) == ("api", (), None, None)
        assert [x.id for x in store.list("alice").items] == ["m1"]
        assert store.list_turns("alice").total == 0
        indexes = {r[0] for r in store._conn().execute("SELECT name FROM sqlite_master WHERE type = 'index'")}
        assert {"memories_by_slot", "turns_by_formation", "turns_by_session"} <= indexes


def test_log_turns_writes_turns_not_memories(store):
    seen = []
    store.subscribe(seen.append)
    logged = store.log_turns(
        "alice",
        [
            {"role": "user", "content": "I moved to Berlin", "chat_time": "2024-03-01T09:00:00Z"},
            {"role": "assistant", "content": "Nice!"},
            {"role": "user", "content": "my dog is Rex", "name": "Alice"},
        ],
        session_id="s1",
        chat_time="2024-03-01T10:00:00Z",
    )
    assert [(t.role, t.speaker, t.text, t.chat_time, t.formation, t.attempts, t.error) for t in logged] == [
        ("user", None, "I moved to Berlin", "2024-03-01T09:00:00.000000Z", "pending", 0, None),
        ("assistant", None, "Nice!", "2024-03-01T10:00:00.000000Z", "skipped", 0, None),
        ("user", "Alice", "my dog is Rex", "2024-03-01T10:00:00.000000Z", "pending", 0, None),
    ]
    assert {t.created_at for t in logged} == {"2024-01-01T00:00:00.000000Z"}
    assert all(t.user_id == "alice" and t.session_id == "s1" and len(t.id) == 32 for t in logged)
    assert seen == [] and store.count("alice") == 0
    assert logged[2].to_dict() == {
        "id": logged[2].id,
        "user_id": "alice",
        "session_id": "s1",
        "role": "user",
        "speaker": "Alice",
        "text": "my dog is Rex",
        "chat_time": "2024-03-01T10:00:00.000000Z",
        "created_at": "2024-01-01T00:00:00.000000Z",
        "formation": "pending",
        "attempts": 0,
        "error": None,
        "updated_at": "2024-01-01T00:00:00.000000Z",
    }


def test_log_turns_without_chat_time_uses_now_and_form_roles(store):
    [a, b] = store.log_turns(
        "alice", [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}], form_roles=()
    )
    assert (a.chat_time, a.formation, b.formation) == ("2024-01-01T00:00:00.000000Z", "skipped", "skipped")
    [c] = store.log_turns("alice", [{"role": "assistant", "content": "z"}], form_roles=("user", "assistant"))
    assert c.formation == "pending"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"messages": []}, r"messages must be a non-empty list of \{role, content, chat_time\?, name\?\}"),
        ({"messages": [{"role": "user", "content": "x", "extra": 1}]}, "messages\\[0\\] has unknown key"),
        ({"messages": [{"role": "", "content": "x"}]}, "messages\\[0\\].role must be a non-empty string"),
        ({"messages": [{"role": "user", "content": ""}]}, "messages\\[0\\].content is empty"),
        ({"messages": [{"role": "user", "content": "x", "name": ""}]}, "messages\\[0\\].name must be"),
        ({"messages": [{"role": "user", "content": "x"}], "session_id": ""}, "session_id must be"),
        ({"messages": [{"role": "user", "content": "x"}], "chat_time": "soon"}, "chat_time is not an ISO"),
        (
            {"messages": [{"role": "user", "content": "x"}], "form_roles": "user"},
            "form_roles must be a tuple",
        ),
    ],
)
def test_log_turns_refuses_bad_input(store, kwargs, message):
    with pytest.raises(InvalidMemoryInput, match=message):
        store.log_turns("alice", **kwargs)
    assert store.list_turns("alice").total == 0


def test_list_turns_newest_first_paged_and_by_session(store):
    logged = store.log_turns(
        "alice",
        [
            {"role": "user", "content": "one", "chat_time": "2024-02-01T00:00:00Z"},
            {"role": "user", "content": "two", "chat_time": "2024-02-03T00:00:00Z"},
            {"role": "user", "content": "three", "chat_time": "2024-02-03T00:00:00Z"},
        ],
        session_id="s1",
    )
    [other] = store.log_turns(
        "alice", [{"role": "user", "content": "four", "chat_time": "2024-02-02T00:00:00Z"}]
    )
    store.log_turns("bob", [{"role": "user", "content": "bob's"}])
    page = store.list_turns("alice")
    assert [t.text for t in page.items] == ["three", "two", "four", "one"]
    assert (page.page, page.page_size, page.total) == (1, 20, 4)
    second = store.list_turns("alice", page=2, page_size=3)
    assert ([t.id for t in second.items], second.total) == ([logged[0].id], 4)
    assert [t.text for t in store.list_turns("alice", session_id="s1").items] == ["three", "two", "one"]
    assert store.list_turns("alice", session_id="s1").total == 3
    assert other.session_id is None
    with pytest.raises(InvalidMemoryInput, match="page_size must be an int in \\[1, 1000\\], got 0"):
        store.list_turns("alice", page_size=0)


def test_formation_queue(store):
    turns = store.log_turns(
        "alice",
        [
            {"role": "user", "content": "late", "chat_time": "2024-02-02T00:00:00Z"},
            {"role": "user", "content": "early", "chat_time": "2024-02-01T00:00:00Z"},
            {"role": "assistant", "content": "reply", "chat_time": "2024-02-01T00:00:00Z"},
            {"role": "user", "content": "later", "chat_time": "2024-02-03T00:00:00Z"},
        ],
    )
    late, early, _, later = turns
    store.log_turns("bob", [{"role": "user", "content": "bob's"}])
    assert [t.text for t in store.pending_turns("alice")] == ["early", "late", "later"]
    assert [t.text for t in store.pending_turns("alice", limit=2)] == ["early", "late"]
    assert store.users_with_pending_turns() == ["alice", "bob"]
    assert store.formation_counts("alice") == FormationCounts(pending=3, dead=0)
    assert store.formation_counts() == FormationCounts(pending=4, dead=0)

    # a transient failure: attempts + 1, still pending; the error is cut to 500 characters
    store.fail_turns("alice", [early.id, late.id], "x" * 600, dead=False)
    pending = {t.id: t for t in store.pending_turns("alice")}
    assert (pending[early.id].attempts, pending[early.id].error) == (1, "x" * 500)
    assert (pending[later.id].attempts, pending[later.id].error) == (0, None)
    assert pending[early.id].updated_at > pending[later.id].updated_at
    # given up on: dead, out of the queue
    store.fail_turns("alice", [early.id], "bad json", dead=True)
    assert [t.text for t in store.pending_turns("alice")] == ["late", "later"]
    [dead] = store.dead_turns("alice")
    assert (dead.id, dead.formation, dead.attempts, dead.error) == (early.id, "dead", 2, "bad json")
    assert store.formation_counts("alice") == FormationCounts(pending=2, dead=1)
    assert store.formation_counts() == FormationCounts(pending=3, dead=1)
    # a dead turn is not failed again; another user's ids are ignored
    store.fail_turns("alice", [early.id], "again", dead=True)
    store.fail_turns("bob", [later.id], "not bob's", dead=True)
    assert store.dead_turns("alice")[0].attempts == 2
    assert store.pending_turns("alice")[1].error is None
    assert store.dead_turns("bob") == []
    # requeue: pending again, attempts 0, error cleared
    assert store.requeue_dead_turns("alice") == 1
    assert store.requeue_dead_turns("alice") == 0
    requeued = store.pending_turns("alice")[0]
    assert (requeued.id, requeued.formation, requeued.attempts, requeued.error) == (
        early.id,
        "pending",
        0,
        None,
    )
    assert store.formation_counts("alice") == FormationCounts(pending=3, dead=0)


def test_queue_calls_refuse_bad_input(store):
    with pytest.raises(InvalidMemoryInput, match="turn_ids must be a list of ids, got 'abc'"):
        store.fail_turns("alice", "abc", "e", dead=True)
    with pytest.raises(InvalidMemoryInput, match="turn_ids\\[1\\] must be a non-empty string, got ''"):
        store.fail_turns("alice", ["a", ""], "e", dead=True)
    with pytest.raises(InvalidMemoryInput, match="error must be a string, got int"):
        store.fail_turns("alice", ["a"], 3, dead=True)
    with pytest.raises(InvalidMemoryInput, match="dead must be a bool, got 1"):
        store.fail_turns("alice", ["a"], "e", dead=1)
    with pytest.raises(InvalidMemoryInput, match="limit must be an int in \\[1, 1000\\], got 0"):
        store.pending_turns("alice", limit=0)
    with pytest.raises(InvalidMemoryInput, match="user_id must be a non-empty string, got ''"):
        store.formation_counts("")


def _formed(store, user, text, turns, **kwargs):
    add = FormedMemory(
        text=text,
        source_turn_ids=tuple(t.id for t in turns),
        valid_from=turns[0].chat_time,
        chat_time=turns[0].chat_time,
        **kwargs,
    )
    return store.commit_formed(user, [t.id for t in turns], [add], [], [], extractor="test").added[0]


def _turn_ids(store, user):
    return {t.id for t in store.list_turns(user, page_size=1000).items}


def test_delete_cascades_to_source_turns(store):
    a, b, c = store.log_turns(
        "alice", [{"role": "user", "content": t} for t in ("I live in Oslo", "I have a cat", "hello")]
    )
    [bob_turn] = store.log_turns("bob", [{"role": "user", "content": "bob's"}])
    oslo = _formed(store, "alice", "I live in Oslo", [a])
    cat = _formed(store, "alice", "I have a cat", [b])
    assert store.delete("alice", oslo.id) == 1
    assert _turn_ids(store, "alice") == {b.id, c.id}
    # keep the log: the memory goes, its turn stays
    assert store.delete("alice", cat.id, delete_turns=False) == 1
    assert _turn_ids(store, "alice") == {b.id, c.id}
    # the tombstone forgets its provenance and slot
    row = (
        store._conn()
        .execute("SELECT source_turn_ids, slot, slot_value FROM memories WHERE id = ?", (oslo.id,))
        .fetchone()
    )
    assert row == ("[]", None, None)
    # a memory of alice citing bob's turn id (formation would drop it; a dump can carry it) leaves bob's turn
    line = {**cat.to_dict(), "id": "imported", "source_turn_ids": [bob_turn.id, c.id], "history": []}
    line.update(text="imported", state="active", version=1)
    assert store.import_jsonl(io.StringIO(json.dumps(line) + "\n")) == 1
    assert store.delete("alice", "imported") == 1
    assert _turn_ids(store, "bob") == {bob_turn.id}
    assert _turn_ids(store, "alice") == {b.id}
    [c] = store.log_turns("alice", [{"role": "user", "content": "hello"}])
    # deleting nothing deletes no turn
    assert store.delete("alice", "missing") == 0
    assert _turn_ids(store, "alice") == {b.id, c.id}


def test_delete_session_and_user_clear_turns(store):
    s1 = store.log_turns(
        "alice", [{"role": "user", "content": "one"}, {"role": "user", "content": "two"}], session_id="s1"
    )
    [s2] = store.log_turns("alice", [{"role": "user", "content": "three"}], session_id="s2")
    [bob_turn] = store.log_turns("bob", [{"role": "user", "content": "bob's"}], session_id="s1")
    # no memories in s1: no memory deleted, the session's turns still go
    assert store.delete_session("alice", "s1") == 0
    assert _turn_ids(store, "alice") == {s2.id}
    assert _turn_ids(store, "bob") == {bob_turn.id}
    _formed(store, "alice", "three", [s2], session_id="s2")
    store.add("alice", "api memory", session_id="s2")
    [again] = store.log_turns("alice", [{"role": "user", "content": "four"}], session_id="s3")
    assert store.delete_session("alice", "s2") == 2
    assert _turn_ids(store, "alice") == {again.id}
    assert store.delete_user("alice") == 0
    assert _turn_ids(store, "alice") == set()
    assert store.formation_counts("alice") == FormationCounts(pending=0, dead=0)
    assert _turn_ids(store, "bob") == {bob_turn.id}
    assert s1[0].id not in _turn_ids(store, "alice")


def test_a_turn_admitted_before_a_delete_all_is_not_logged_after_it(store):
    """Issue 27 item 5a: a chat request admitted at generation g logs its turn with admitted_generation=g; a
    delete_user in between (memories or only log turns) wins, a request admitted after it logs as before."""
    hi = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    store.log_turns("alice", hi)
    before = store.generation("alice")  # only log turns: no memory ever written
    bobs = store.generation("bob")
    assert store.delete_user("alice") == 0  # the log went: the generation moves all the same
    assert store.generation("alice") == before + 1
    assert store.log_turns("alice", hi, admitted_generation=before) == []
    assert _turn_ids(store, "alice") == set()
    after = store.generation("alice")
    logged = store.log_turns("alice", hi, admitted_generation=after)
    assert _turn_ids(store, "alice") == {t.id for t in logged} and len(logged) == 2
    [m] = store.add("alice", "I live in Oslo")  # an add moves the generation: not an erasure
    assert len(store.log_turns("alice", hi, admitted_generation=after)) == 2
    assert store.delete_user("alice") == 1
    assert store.log_turns("alice", hi, admitted_generation=store.generation("alice") - 1) == []
    assert store.list_turns("alice").total == 0
    assert len(store.log_turns("bob", hi, admitted_generation=bobs)) == 2  # another user's delete: not bob's
    with pytest.raises(InvalidMemoryInput, match="admitted_generation must be an int"):
        store.log_turns("alice", hi, admitted_generation=-1)


def test_turn_record_is_frozen(store):
    [t] = store.log_turns("alice", [{"role": "user", "content": "x"}])
    assert isinstance(t, Turn)
    with pytest.raises(AttributeError):
        t.text = "y"  # type: ignore[misc]


def test_list_turns_by_time_range(store) -> None:
    """What the user said in a period (a time question over the log), inclusive, newest first."""
    messages = [
        {"role": "user", "content": f"turn on day {day}", "chat_time": f"2026-11-{day:02d}T10:00:00Z"}
        for day in (1, 8, 15, 22)
    ]
    store.log_turns("u", messages)
    week = store.list_turns("u", start="2026-11-08T00:00:00Z", end="2026-11-15T10:00:00Z")
    assert [t.text for t in week.items] == ["turn on day 15", "turn on day 8"] and week.total == 2
    assert [t.text for t in store.list_turns("u", start="2026-11-20T00:00:00Z").items] == ["turn on day 22"]
    with pytest.raises(InvalidMemoryInput, match="end is not an ISO 8601 time: 'last week'"):
        store.list_turns("u", end="last week")


def test_a_turn_admitted_before_a_session_delete_is_not_logged_into_it_after(store):
    """Issue 42 item 10: a request admitted at generation g into session s1 logs nothing into s1 once s1 was
    deleted after g (the session had only log turns, or memories too); other sessions, other users, and
    requests admitted after the delete log as before."""
    hi = [{"role": "user", "content": "hi"}]
    store.log_turns("alice", hi, session_id="s1")
    before = store.generation("alice")
    assert store.delete_session("alice", "s1") == 0  # only log turns: the generation moves all the same
    assert store.generation("alice") == before + 1
    assert store.log_turns("alice", hi, session_id="s1", admitted_generation=before) == []
    assert store.list_turns("alice").total == 0
    [other] = store.log_turns("alice", hi, session_id="s2", admitted_generation=before)
    assert store.log_turns("bob", hi, session_id="s1", admitted_generation=0) != []
    after = store.generation("alice")
    [again] = store.log_turns("alice", hi, session_id="s1", admitted_generation=after)
    assert _turn_ids(store, "alice") == {other.id, again.id}
    _formed(store, "alice", "I live in Oslo", [again], session_id="s1")
    admitted = store.generation("alice")
    assert store.delete_session("alice", "s1") == 1
    assert store.log_turns("alice", hi, session_id="s1", admitted_generation=admitted) == []
    assert _turn_ids(store, "alice") == {other.id}


def test_a_memory_delete_removes_the_replies_that_repeat_it(store):
    """Issue 42 item 27: deleting a memory deletes its source turns, the replies to them, and every reply
    generated with it (log_turns' reply_to and used_memory_ids), in the delete's transaction; a reply to a
    deleted turn, or made with a deleted memory, is not logged after the delete."""
    [said] = store.log_turns("alice", [{"role": "user", "content": "I am allergic to peanuts."}])
    [echo] = store.log_turns(
        "alice", [{"role": "assistant", "content": "Noted: peanuts."}], reply_to=said.id, form_roles=()
    )
    allergy = _formed(store, "alice", "I am allergic to peanuts.", [said])
    [cat] = store.add("alice", "My cat is called Pixel.")
    [ask] = store.log_turns("alice", [{"role": "user", "content": "What can I eat?"}])
    [used] = store.log_turns(
        "alice",
        [{"role": "assistant", "content": "Anything without peanuts."}],
        reply_to=ask.id,
        used_memory_ids=[allergy.id, cat.id],
    )
    [other_ask] = store.log_turns("alice", [{"role": "user", "content": "My cat?"}])
    [other] = store.log_turns(
        "alice",
        [{"role": "assistant", "content": "Pixel."}],
        reply_to=other_ask.id,
        used_memory_ids=[cat.id],
    )
    assert _turn_ids(store, "alice") == {said.id, echo.id, ask.id, used.id, other_ask.id, other.id}
    assert store.delete("alice", allergy.id) == 1
    assert _turn_ids(store, "alice") == {ask.id, other_ask.id, other.id}
    # a reply finishing after the delete is not logged: its turn is gone, or it used the deleted memory
    late = [{"role": "assistant", "content": "Peanuts, again."}]
    assert store.log_turns("alice", late, reply_to=said.id) == []
    assert store.log_turns("alice", late, reply_to=ask.id, used_memory_ids=[allergy.id]) == []
    assert _turn_ids(store, "alice") == {ask.id, other_ask.id, other.id}
    # keep_turns leaves the log as it is, replies included
    assert store.delete("alice", cat.id, delete_turns=False) == 1
    assert _turn_ids(store, "alice") == {ask.id, other_ask.id, other.id}
    with pytest.raises(InvalidMemoryInput, match="used_memory_ids must be a list of ids"):
        store.log_turns("alice", late, used_memory_ids="m1")
