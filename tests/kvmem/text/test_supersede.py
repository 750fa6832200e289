"""Formation's writes: commit_formed (provenance, duplicates, supersession, turns deleted meanwhile), what a
superseded memory is served in (nothing, unless include_superseded), supersede, slot_candidates, add's slots,
change events, isolation, and dumps of the new fields."""

from __future__ import annotations

import io
import json

import pytest

from kvmem.text import ChangeEvent, HashEmbedder, InvalidMemoryInput, MemoryNotFound, MemoryStore
from kvmem.text.records import FormedMemory, MemoryVersion

MODES = ("keyword", "dense", "hybrid")


def _log(store, user, *texts, session_id=None, day=1):
    return store.log_turns(
        user,
        [{"role": "user", "content": t, "chat_time": f"2024-02-{day:02d}T10:00:00Z"} for t in texts],
        session_id=session_id,
    )


def _add(text, turns, slot=None, value=None, valid_from=None, kind="fact", session_id=None):
    return FormedMemory(
        text=text,
        source_turn_ids=tuple(t.id for t in turns),
        valid_from=valid_from or turns[0].chat_time,
        chat_time=turns[0].chat_time,
        session_id=session_id,
        slot=slot,
        slot_value=value,
        kind=kind,
    )


def _top1(store, user, query, **kwargs):
    """The best hit of each search mode: a superseded memory must not even take a place in the ranking."""
    return {
        mode: [h.memory.id for h in store.search(user, query, mode=mode, top_k=1, **kwargs)] for mode in MODES
    }


def _served_ids(store, user, query, **kwargs):
    """Ids returned by every search mode, list and memories_by_ids (which must agree)."""
    found = {mode: {h.memory.id for h in store.search(user, query, mode=mode, **kwargs)} for mode in MODES}
    found["list"] = {m.id for m in store.list(user, page_size=100, **kwargs).items}
    return found


def test_commit_formed_adds_with_provenance(store, clock):
    seen = []
    store.subscribe(seen.append)
    t1, t2 = _log(store, "alice", "I moved to Berlin last week", "my dog Rex loves it", session_id="s1")
    [other] = _log(store, "alice", "still pending")
    now = "2024-01-01T00:00:02.000000Z"  # the third clock reading: two log_turns calls came first
    result = store.commit_formed(
        "alice",
        [t1.id, t2.id],
        [
            _add(
                "I live in Berlin", [t1], "user|home_city", "berlin", "2024-01-25T00:00:00Z", session_id="s1"
            ),
            _add("My dog is called Rex", [t1, t2], "user|dog.name", "rex", kind="relation"),
        ],
        [],
        [],
        extractor="rules-v1",
    )
    berlin, rex = result.added
    assert (result.superseded_ids, result.dropped) == ([], 0)
    assert berlin.to_dict() == {
        "id": berlin.id,
        "user_id": "alice",
        "session_id": "s1",
        "agent_id": None,
        "role": "user",
        "text": "I live in Berlin",
        "created_at": now,
        "chat_time": "2024-02-01T10:00:00.000000Z",
        "updated_at": now,
        "tags": [],
        "metadata": {"kind": "fact", "extractor": "rules-v1"},
        "state": "active",
        "version": 1,
        "valid_from": "2024-01-25T00:00:00.000000Z",
        "valid_to": None,
        "superseded_by": None,
        "source": "conversation",
        "source_turn_ids": [t1.id],
        "slot": "user|home_city",
    }
    assert berlin.slot_value == "berlin"
    assert (rex.source_turn_ids, rex.metadata, rex.valid_from) == (
        (t1.id, t2.id),
        {"kind": "relation", "extractor": "rules-v1"},
        "2024-02-01T10:00:00.000000Z",
    )
    assert store.get("alice", berlin.id) == berlin and store.get("alice", rex.id) == rex
    assert seen == [ChangeEvent(berlin.id, "alice", "added"), ChangeEvent(rex.id, "alice", "added")]
    assert {t.id: t.formation for t in store.list_turns("alice").items} == {
        t1.id: "formed",
        t2.id: "formed",
        other.id: "pending",
    }
    assert [t.id for t in store.pending_turns("alice")] == [other.id]
    for mode in MODES:
        assert store.search("alice", "Berlin", mode=mode)[0].memory.id == berlin.id


def test_duplicates_gain_provenance_without_a_new_version(store):
    [t1] = _log(store, "alice", "I live in Berlin")
    [berlin] = store.commit_formed(
        "alice", [t1.id], [_add("I live in Berlin", [t1])], [], [], extractor="x"
    ).added
    t2, t3 = _log(store, "alice", "Berlin is home", "yes, Berlin", day=2)
    [api] = store.add("alice", "Berlin note")
    seen = []
    store.subscribe(seen.append)
    result = store.commit_formed(
        "alice",
        [t2.id, t3.id],
        [],
        [(berlin.id, (t2.id, t1.id)), (api.id, (t3.id,)), ("missing", (t3.id,))],
        [],
        extractor="x",
    )
    assert (result.added, result.superseded_ids, result.dropped) == ([], [], 0)
    again = store.get("alice", berlin.id)
    assert again.source_turn_ids == (t1.id, t2.id)
    assert (again.version, again.updated_at, again.text) == (1, berlin.updated_at, berlin.text)
    assert store.history("alice", berlin.id) == []
    assert store.get("alice", api.id).source_turn_ids == (t3.id,)
    assert seen == []
    assert {t.formation for t in store.list_turns("alice").items} == {"formed"}


def test_supersession_hides_the_old_memory_except_when_asked(store):
    [t1] = _log(store, "alice", "I live in Berlin")
    [berlin] = store.commit_formed(
        "alice", [t1.id], [_add("I live in Berlin", [t1], "user|home_city", "berlin")], [], [], extractor="x"
    ).added
    # fill the per-user vector cache before the supersession, so a stale matrix would show
    assert _served_ids(store, "alice", "where do I live Berlin Paris")["dense"] == {berlin.id}
    [t2] = _log(store, "alice", "I moved to Paris", day=9)
    seen = []
    store.subscribe(seen.append)
    result = store.commit_formed(
        "alice",
        [t2.id],
        [_add("I live in Paris", [t2], "user|home_city", "paris")],
        [],
        [(berlin.id, 0)],
        extractor="x",
    )
    [paris] = result.added
    assert (result.superseded_ids, result.dropped) == ([berlin.id], 0)
    assert seen == [ChangeEvent(paris.id, "alice", "added"), ChangeEvent(berlin.id, "alice", "updated")]
    assert seen[1].text_changed is True
    old = store.get("alice", berlin.id)
    assert (old.valid_from, old.valid_to, old.superseded_by) == (
        "2024-02-01T10:00:00.000000Z",
        "2024-02-09T10:00:00.000000Z",
        paris.id,
    )
    assert (old.version, old.state, old.text, old.slot, old.slot_value) == (
        2,
        "active",
        "I live in Berlin",
        "user|home_city",
        "berlin",
    )
    assert old.updated_at == paris.created_at and not old.is_served and paris.is_served
    assert store.history("alice", berlin.id) == [
        MemoryVersion(1, "I live in Berlin", (), {"kind": "fact", "extractor": "x"}, berlin.updated_at)
    ]
    query = "where do I live Berlin Paris"
    assert _served_ids(store, "alice", query) == {k: {paris.id} for k in (*MODES, "list")}
    assert _top1(store, "alice", "I live in Berlin") == {mode: [paris.id] for mode in MODES}
    assert store.list("alice").total == 1 and store.list("alice", state="all").total == 1
    assert store.memories_by_ids("alice", [berlin.id, paris.id]) == [store.get("alice", paris.id)]
    assert store.count("alice") == 2 and store.count_by_user() == {"alice": 2}
    # asked for: superseded ones come back, and the cached (served) matrix is untouched by the asking
    assert _served_ids(store, "alice", query, include_superseded=True) == {
        k: {berlin.id, paris.id} for k in (*MODES, "list")
    }
    assert store.list("alice", include_superseded=True).total == 2
    assert store.memories_by_ids("alice", [berlin.id, paris.id], include_superseded=True) == [old, paris]
    assert _top1(store, "alice", "I live in Berlin", include_superseded=True) == {
        mode: [berlin.id] for mode in MODES
    }
    assert _served_ids(store, "alice", query)["dense"] == {paris.id}
    assert _top1(store, "alice", "I live in Berlin") == {mode: [paris.id] for mode in MODES}
    # only served memories are slot candidates; a superseded one cannot be superseded again
    assert store.slot_candidates("alice", "user|home_city") == [paris]
    [t3] = _log(store, "alice", "now Rome", day=20)
    again = store.commit_formed(
        "alice",
        [t3.id],
        [_add("I live in Rome", [t3], "user|home_city", "rome")],
        [],
        [(berlin.id, 0)],
        extractor="x",
    )
    assert again.superseded_ids == [] and store.get("alice", berlin.id).superseded_by == paris.id
    # no supersession: the cached matrix was extended by the new row (as add does), not dropped
    [rome] = again.added
    assert store._vectors.get(
        "alice",
        store._conn().execute("SELECT gen FROM user_generation WHERE user_id = ?", ("alice",)).fetchone()[0],
    )
    assert _top1(store, "alice", "I live in Rome") == {mode: [rome.id] for mode in MODES}


def test_superseded_valid_to_is_now_when_the_old_fact_is_newer(store, clock):
    [t1] = _log(store, "alice", "I work at Acme", day=20)
    [acme] = store.commit_formed(
        "alice", [t1.id], [_add("I work at Acme", [t1])], [], [], extractor="x"
    ).added
    [t2] = _log(store, "alice", "I work at Initech since January", day=21)
    now = "2024-01-01T00:00:03.000000Z"  # the fourth clock reading
    result = store.commit_formed(
        "alice",
        [t2.id],
        [_add("I work at Initech", [t2], valid_from="2024-01-05T00:00:00Z")],
        [],
        [(acme.id, 0)],
        extractor="x",
    )
    assert store.get("alice", acme.id).valid_to == now == result.added[0].created_at


def test_a_turn_deleted_before_commit_drops_the_adds_citing_it(store):
    [t1] = _log(store, "alice", "I live in Berlin")
    [berlin] = store.commit_formed(
        "alice", [t1.id], [_add("I live in Berlin", [t1])], [], [], extractor="x"
    ).added
    t2, t3 = _log(store, "alice", "I moved to Paris", "I like tea", day=9)
    store._conn().execute("DELETE FROM turns WHERE id = ?", (t2.id,))  # deleted while the extractor ran
    seen = []
    store.subscribe(seen.append)
    before = store._conn().execute("SELECT count(*) FROM memories").fetchone()[0]
    result = store.commit_formed(
        "alice",
        [t2.id, t3.id],
        [_add("I live in Paris", [t2]), _add("I like tea", [t3]), _add("Paris with tea", [t2, t3])],
        [(berlin.id, (t2.id,))],
        [(berlin.id, 0), (berlin.id, 2)],
        extractor="x",
    )
    [tea] = result.added
    assert (tea.text, result.superseded_ids, result.dropped) == ("I like tea", [], 2)
    assert store._conn().execute("SELECT count(*) FROM memories").fetchone()[0] == before + 1
    assert seen == [ChangeEvent(tea.id, "alice", "added")]
    kept = store.get("alice", berlin.id)
    assert (kept.valid_to, kept.superseded_by, kept.source_turn_ids, kept.version) == (
        None,
        None,
        (t1.id,),
        1,
    )
    assert {t.id: t.formation for t in store.list_turns("alice").items} == {t1.id: "formed", t3.id: "formed"}


def test_within_batch_supersession(store):
    [tea] = store.add("alice", "I like tea")
    assert _top1(store, "alice", "tea") == {mode: [tea.id] for mode in MODES}  # the vector cache is filled
    t1, t2 = _log(store, "alice", "I live in Berlin", "no wait, I moved to Paris")
    result = store.commit_formed(
        "alice",
        [t1.id, t2.id],
        [_add("I live in Berlin", [t1]), _add("I live in Paris", [t2], valid_from="2024-02-03T00:00:00Z")],
        [],
        [(0, 1)],
        extractor="x",
    )
    berlin, paris = result.added
    assert result.superseded_ids == [berlin.id]
    assert (berlin.valid_to, berlin.superseded_by, berlin.version) == (
        "2024-02-03T00:00:00.000000Z",
        paris.id,
        1,
    )
    assert store.get("alice", berlin.id) == berlin
    assert {h.memory.id for h in store.search("alice", "live Berlin Paris", mode="dense")} == {
        paris.id,
        tea.id,
    }
    assert _top1(store, "alice", "I live in Berlin") == {mode: [paris.id] for mode in MODES}
    with pytest.raises(InvalidMemoryInput, match="supersessions\\[0\\]: add 1 cannot supersede itself"):
        store.commit_formed("alice", [], [_add("x", [t1]), _add("y", [t1])], [], [(1, 1)], extractor="x")


def test_supersede_two_existing_memories(store):
    old, new = store.add(
        "alice", texts=["I drive a Volvo", "I drive a Tesla"], slots=[("user|car", "volvo"), None]
    )
    [bobs] = store.add("bob", "I drive a Fiat")
    assert (old.slot, old.slot_value, old.source, old.valid_from) == (
        "user|car",
        "volvo",
        "api",
        old.chat_time,
    )
    assert store.slot_candidates("alice", "user|car") == [old]
    assert _top1(store, "alice", "I drive a Volvo") == {mode: [old.id] for mode in MODES}  # cached now
    seen = []
    store.subscribe(seen.append)
    superseded = store.supersede("alice", old.id, new.id)
    assert _top1(store, "alice", "I drive a Volvo") == {mode: [new.id] for mode in MODES}
    assert (superseded.superseded_by, superseded.valid_to, superseded.version) == (new.id, new.valid_from, 2)
    assert store.get("alice", old.id) == superseded
    assert seen == [ChangeEvent(old.id, "alice", "updated")]
    assert store.slot_candidates("alice", "user|car") == []
    for args in (
        (old.id, new.id),
        (new.id, old.id),
        (new.id, bobs.id),
        (bobs.id, new.id),
        ("missing", new.id),
    ):
        with pytest.raises(MemoryNotFound):
            store.supersede("alice", *args)
    with pytest.raises(InvalidMemoryInput, match="a memory cannot supersede itself"):
        store.supersede("alice", new.id, new.id)
    assert len(seen) == 1
    # deleting the newer memory leaves the old one superseded
    assert store.delete("alice", new.id) == 1
    assert store.get("alice", old.id).superseded_by == new.id and store.list("alice").total == 0


def test_add_slots_are_checked(store):
    with pytest.raises(InvalidMemoryInput, match="slots must be a list of 2"):
        store.add("alice", texts=["a", "b"], slots=[None])
    with pytest.raises(InvalidMemoryInput, match="slots\\[0\\] must be None or a \\(slot, value\\) pair"):
        store.add("alice", "a", slots=[("", "x")])
    with pytest.raises(TypeError):
        store.add("alice", "a", source="conversation")  # type: ignore[call-arg]
    assert store.count("alice") == 0


def test_commit_formed_isolation(store):
    [bob_turn] = _log(store, "bob", "I live in Oslo")
    [bob_memory] = store.add("bob", "I live in Oslo", slots=[("user|home_city", "oslo")])
    [t1] = _log(store, "alice", "I live in Rome")
    result = store.commit_formed(
        "alice",
        [t1.id, bob_turn.id],
        [_add("I live in Rome", [t1]), _add("Oslo stolen", [bob_turn]), _add("both", [t1, bob_turn])],
        [(bob_memory.id, (t1.id,))],
        [(bob_memory.id, 0)],
        extractor="x",
    )
    assert ([m.text for m in result.added], result.superseded_ids, result.dropped) == (
        ["I live in Rome"],
        [],
        2,
    )
    assert store.get("bob", bob_memory.id) == bob_memory
    assert [t.formation for t in store.list_turns("bob").items] == ["pending"]
    assert store.count("bob") == 1 and store.count("alice") == 1
    assert store.slot_candidates("alice", "user|home_city") == []


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (([], [object()], [], []), "adds\\[0\\] must be a FormedMemory, got object"),
        (
            ([], [FormedMemory("x", (), "2024-01-01", "2024-01-01")], [], []),
            "adds\\[0\\].source_turn_ids must name",
        ),
        (
            ([], [FormedMemory("x", ("t",), "later", "2024-01-01")], [], []),
            "adds\\[0\\].valid_from is not an ISO",
        ),
        (([], [FormedMemory("", ("t",), "2024-01-01", "2024-01-01")], [], []), "adds\\[0\\].text is empty"),
        (([], [FormedMemory("x", ("t",), "2024-01-01", "2024-01-01", kind="")], [], []), "adds\\[0\\].kind"),
        (([], [], [("m",)], []), "duplicates\\[0\\] must be a pair"),
        (([], [], [("m", "t")], []), "duplicates\\[0\\]\\[1\\] must be a list of ids"),
        (([], [], [], [("m", 0)]), "supersessions\\[0\\]\\[1\\] must be an int in \\[0, -1\\], got 0"),
        (([], [], [], [(None, 0)]), "supersessions\\[0\\]\\[0\\] must be a memory id or an add index"),
        (("t", [], [], []), "turn_ids must be a list of ids"),
    ],
)
def test_commit_formed_refuses_bad_input(store, args, message):
    with pytest.raises(InvalidMemoryInput, match=message):
        store.commit_formed("alice", *args, extractor="x")
    with pytest.raises(InvalidMemoryInput, match="extractor must be a non-empty string"):
        store.commit_formed("alice", [], [], [], [], extractor="")


def test_dump_round_trip_keeps_the_new_fields(store, tmp_path):
    [t1] = _log(store, "alice", "I live in Berlin")
    [berlin] = store.commit_formed(
        "alice", [t1.id], [_add("I live in Berlin", [t1], "user|home_city", "berlin")], [], [], extractor="x"
    ).added
    [t2] = _log(store, "alice", "I moved to Paris", day=9)
    [paris] = store.commit_formed(
        "alice",
        [t2.id],
        [_add("I live in Paris", [t2], "user|home_city", "paris")],
        [],
        [(berlin.id, 0)],
        extractor="x",
    ).added
    [plain] = store.add("alice", "plain", slots=[("user|x", "y")])
    path = tmp_path / "dump.jsonl"
    assert store.export_jsonl(path) == 3
    lines = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    assert (lines[0]["superseded_by"], lines[0]["slot_value"], lines[0]["source_turn_ids"]) == (
        paris.id,
        "berlin",
        [t1.id],
    )
    with MemoryStore(tmp_path / "copy.db", embedder=HashEmbedder()) as copy:
        assert copy.import_jsonl(path) == 3
        everything = lambda s: s.list("alice", page_size=100, include_superseded=True).items  # noqa: E731
        assert everything(copy) == everything(store)
        assert [m.id for m in copy.list("alice").items] == [m.id for m in store.list("alice").items]
        assert {h.memory.id for h in copy.search("alice", "live Berlin Paris", mode="dense")} == {
            paris.id,
            plain.id,
        }
        assert copy.list_turns("alice").total == 0  # the log is not part of a dump
        again = io.StringIO()
        copy.export_jsonl(again)
        assert again.getvalue() == path.read_text(encoding="utf-8")


def test_an_old_dump_imports_with_defaults(store):
    line = {
        "id": "old1",
        "user_id": "alice",
        "session_id": None,
        "agent_id": None,
        "role": None,
        "text": "written before supersession",
        "created_at": "2023-01-01T00:00:00Z",
        "chat_time": "2022-12-31T00:00:00Z",
        "updated_at": "2023-01-01T00:00:00Z",
        "tags": [],
        "metadata": {},
        "state": "active",
        "version": 1,
        "history": [],
    }
    assert store.import_jsonl(io.StringIO(json.dumps(line) + "\n")) == 1
    m = store.get("alice", "old1")
    assert (m.valid_from, m.valid_to, m.superseded_by, m.source, m.source_turn_ids, m.slot, m.slot_value) == (
        "2022-12-31T00:00:00.000000Z",
        None,
        None,
        "api",
        (),
        None,
        None,
    )
    bad = {**line, "id": "old2", "source": "magic"}
    with pytest.raises(InvalidMemoryInput, match="line 1: source must be one of \\['api', 'conversation'\\]"):
        store.import_jsonl(io.StringIO(json.dumps(bad) + "\n"))
    half = {**line, "id": "old3", "superseded_by": "x"}
    with pytest.raises(InvalidMemoryInput, match="line 1: valid_to and superseded_by are set together"):
        store.import_jsonl(io.StringIO(json.dumps(half) + "\n"))


def test_slot_candidates_by_prefix(store):
    slots = [
        ("user|partner", "anna"),
        ("user|partner|name", "anna"),
        ("user|partner_x", "1"),
        ("user|partners", "2"),
    ]
    partner, name, *_ = store.add("alice", texts=[f"fact {i}" for i in range(4)], slots=slots)
    store.add("bob", "bob's partner", slots=[("user|partner|name", "eve")])
    assert store.slot_candidates("alice", "user|partner") == [partner]
    assert store.slot_candidates("alice", "user|partner", prefix=True) == [partner, name]
    assert store.slot_candidates("alice", "user|partner|name", prefix=True) == [name]
    assert store.slot_candidates("alice", "user") == []
    with pytest.raises(InvalidMemoryInput, match="slot must be a non-empty string, got ''"):
        store.slot_candidates("alice", "")
