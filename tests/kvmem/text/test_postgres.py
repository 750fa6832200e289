"""What only the PostgreSQL store has: a server that can be away (at start, mid-run, and back), its schema
versions, replicas on one database, and stems and scores the same as SQLite's FTS5."""

from __future__ import annotations

import socket
import threading

import pytest

from kvmem.text import HashEmbedder, MemoryStore, StoreUnavailable, TextStoreError
from kvmem.text.db import pg, pg_schema, schema
from kvmem.text.search.terms import term_counts

pytestmark = pytest.mark.postgresql


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _open(url: str, **kwargs) -> MemoryStore:
    return MemoryStore(url, embedder=HashEmbedder(), **kwargs)


def test_unreachable_at_start_names_postgresql_and_where_without_the_password():
    port = _free_port()
    with pytest.raises(StoreUnavailable) as info:
        _open(f"postgresql://kv:s3cret@127.0.0.1:{port}/memories")
    message = str(info.value)
    assert message.startswith(f"postgresql at 127.0.0.1:{port} is unreachable: ")
    assert "s3cret" not in message
    assert (info.value.dependency, info.value.where) == ("postgresql", f"127.0.0.1:{port}")


def test_server_away_mid_run_fails_the_call_and_the_store_recovers_when_it_returns(pg_server, pg_url):
    store = _open(pg_url)
    [a] = store.add("alice", "apples before the outage")
    assert [h.memory.id for h in store.search("alice", "apples")] == [a.id]
    pg_server.stop()
    try:
        where = f"127.0.0.1:{pg_server.port}"
        with pytest.raises(StoreUnavailable, match=f"^postgresql at {where} is unreachable: "):
            store.add("alice", "pears during the outage")
        with pytest.raises(StoreUnavailable, match=f"^postgresql at {where} is unreachable: "):
            store.search("alice", "apples")
        with pytest.raises(StoreUnavailable):
            store.get("alice", a.id)
    finally:
        pg_server.start()
    # back: the next calls reconnect by themselves; the failed add wrote nothing
    assert store.get("alice", a.id).text == "apples before the outage"
    [b] = store.add("alice", "pears after the outage")
    assert [h.memory.id for h in store.search("alice", "pears", mode="keyword")] == [b.id]
    assert [m.text for m in store.list("alice").items] == [
        "pears after the outage",
        "apples before the outage",
    ]
    store.close()


def test_a_fresh_database_is_created_at_the_current_version(pg_url):
    with _open(pg_url) as store:
        conn = store._conn()
        assert pg_schema.schema_version(conn) == pg_schema.SCHEMA_VERSION == schema.SCHEMA_VERSION
        tables = {
            r[0] for r in conn.execute("SELECT tablename FROM pg_tables WHERE schemaname = current_schema()")
        }
        assert tables == {
            "meta",
            "memories",
            "memory_versions",
            "memory_vectors",
            "user_generation",
            "memory_terms",
            "turns",
            "write_receipts",
            "turn_uses",
            "erased_sessions",
        }
        assert dict(conn.execute("SELECT key, value FROM meta")) == {
            "schema_version": str(schema.SCHEMA_VERSION),
            "embedder": "hash-bow-64",
            "dim": "64",
        }


def test_an_older_database_migrates_one_transaction_per_version(pg_url):
    conn = pg.PgConnection(pg_url)
    assert pg_schema.migrate(conn, target=1) == 1
    conn.execute(
        "INSERT INTO memories (id, user_id, role, text, created_at, chat_time, updated_at, state, version) "
        "VALUES ('m1', 'alice', 'user', 'old text', '2024-01-01T00:00:00Z', '2023-05-01T00:00:00Z', "
        "'2024-01-01T00:00:00Z', 'active', 1)"
    )
    conn.close()
    with _open(pg_url) as store:
        assert pg_schema.schema_version(store._conn()) == schema.SCHEMA_VERSION
        memory = store.get("alice", "m1")
        assert (memory.valid_from, memory.source, memory.source_turn_ids) == (
            "2023-05-01T00:00:00Z",
            "api",
            (),
        )
        assert store.log_turns("alice", [{"role": "user", "content": "hi"}])[0].formation == "pending"


def test_a_newer_database_is_refused_and_left_as_it_was(pg_url):
    with _open(pg_url) as store:
        store.add("alice", "kept")
        store._conn().execute("UPDATE meta SET value = '99' WHERE key = 'schema_version'")
    with pytest.raises(
        TextStoreError,
        match=f"has store schema version 99, newer than this code's {schema.SCHEMA_VERSION}; upgrade kvmem",
    ):
        _open(pg_url)
    conn = pg.PgConnection(pg_url)
    assert conn.execute("SELECT count(*) FROM memories").fetchone()[0] == 1
    conn.close()


def test_migrations_keep_step_with_sqlites():
    assert len(pg_schema.MIGRATIONS) == len(schema.MIGRATIONS)


def test_two_replicas_on_one_database_see_each_others_writes_at_once(pg_url):
    one, two = _open(pg_url), _open(pg_url)
    assert two.search("alice", "apples") == []  # two caches alice's (empty) rows
    [a] = one.add("alice", "apples in the orchard")
    assert [h.memory.id for h in two.search("alice", "apples", mode="keyword")] == [a.id]
    assert [h.memory.id for h in two.search("alice", "orchard", mode="dense")] == [a.id]
    two.update("alice", a.id, text="pears in the orchard")
    assert [h.memory.text for h in one.search("alice", "pears")] == ["pears in the orchard"]
    one.delete("alice", a.id)
    assert two.search("alice", "pears") == [] and two.count("alice") == 0
    one.close()
    two.close()


def test_replicas_starting_together_on_a_fresh_database_migrate_it_once(pg_url):
    """Three replicas open a fresh database while a migration is under way (the migration lock held here):
    each sees no schema, waits for the lock, and then must see the first one's tables (`scripts/cluster.sh up`
    starts replicas together; they failed with "relation meta already exists")."""
    import psycopg

    holder = psycopg.connect(pg_url, autocommit=True)
    holder.execute("SELECT pg_advisory_lock(%s)", (pg_schema.MIGRATE_LOCK_KEY,))
    opened: list[MemoryStore] = []
    errors: list[BaseException] = []

    def replica() -> None:
        try:
            opened.append(_open(pg_url))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=replica) for _ in range(3)]
    for t in threads:
        t.start()
    deadline = 50
    while (
        deadline
        and holder.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
        ).fetchone()[0]
        < 3
    ):
        threading.Event().wait(0.1)
        deadline -= 1
    holder.execute("SELECT pg_advisory_unlock(%s)", (pg_schema.MIGRATE_LOCK_KEY,))
    for t in threads:
        t.join(timeout=60)
    holder.close()
    assert errors == [] and len(opened) == 3
    [a] = opened[0].add("alice", "apples")
    assert [h.memory.id for h in opened[2].search("alice", "apples", mode="keyword")] == [a.id]
    for store in opened:
        store.close()


def test_change_events_are_heard_in_each_users_commit_order(pg_url):
    """Writers lock per user (pg.begin_write): one user's writes commit, and are heard, one after another;
    different users' run at once, so their relative order is not fixed."""
    store = _open(pg_url)
    heard: list[tuple[str, str]] = []
    store.subscribe(lambda event: heard.append((event.user_id, event.memory_id)))

    def work(n: int) -> None:
        for i in range(10):
            store.add(f"user{n}", f"thread {n} item {i}")

    threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    rowid = dict(store._conn().execute("SELECT id, rowid FROM memories"))
    assert len(heard) == 40
    for n in range(4):  # a user's rowids are handed out in their commit order
        theirs = [rowid[i] for user, i in heard if user == f"user{n}"]
        assert len(theirs) == 10 and theirs == sorted(theirs)
    store.close()


def test_stems_are_fts5s_and_keyword_scores_match_sqlite(pg_url, tmp_path):
    assert term_counts(["Running runners ran, CAFÉ café generously"]) == [
        {"run": 1, "runner": 1, "ran": 1, "cafe": 2, "gener": 1}
    ]
    texts = [
        "I went running by the river every morning",
        "The runners ran a marathon in Lisbon",
        "Café au lait at the café near the river",
        "She generously shared her generous lunch",
        "snake_case words and x-ray vision",
    ]
    queries = ["running river", "cafe", "generous", "ran marathon", "snake_case", "x-ray"]
    with _open(pg_url) as on_pg, _open(str(tmp_path / "m.db")) as on_sqlite:
        for s in (on_pg, on_sqlite):
            s.add("alice", texts=texts)
            s.add("bob", texts=["river river river"] * 3)  # another user's rows change nothing
        for q in queries:
            pg_hits = [(h.memory.text, round(h.score, 9)) for h in on_pg.search("alice", q, mode="keyword")]
            sqlite_hits = [
                (h.memory.text, round(h.score, 9)) for h in on_sqlite.search("alice", q, mode="keyword")
            ]
            assert pg_hits == sqlite_hits, q
            assert pg_hits, q


def test_a_statement_error_is_not_an_outage(pg_url):
    with _open(pg_url) as store:
        with pytest.raises(Exception) as info:
            store._conn().execute("SELECT no_such_column FROM memories")
        assert not isinstance(info.value, StoreUnavailable)
        assert store.add("alice", "still fine")[0].text == "still fine"


def test_a_connection_lost_mid_transaction_writes_nothing_and_the_next_call_reconnects(pg_url, monkeypatch):
    import psycopg

    store = _open(pg_url)
    store.add("alice", "before")
    real_insert = MemoryStore._insert
    calls: list[str] = []

    def cut_after_first(conn, memory, vector):
        calls.append(memory.text)
        if len(calls) == 2:  # the server ends this session between two inserts of one transaction
            pid = conn.execute("SELECT pg_backend_pid()").fetchone()[0]
            with psycopg.connect(pg_url, autocommit=True) as admin:
                admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
        return real_insert(conn, memory, vector)

    monkeypatch.setattr(MemoryStore, "_insert", staticmethod(cut_after_first))
    with pytest.raises(StoreUnavailable, match="^postgresql at 127.0.0.1:"):
        store.add("alice", texts=["a", "b", "c"])
    monkeypatch.undo()
    assert calls == ["a", "b"]
    assert [m.text for m in store.list("alice").items] == ["before"]  # a's insert went with the transaction
    assert [m.text for m in store.add("alice", texts=["d"])] == ["d"]
    assert store.count("alice") == 2
    store.close()


def test_writers_lock_per_user_one_users_writes_wait_for_each_other_only(pg_url):
    """Issue 42 item 18: while a write of alice's is open (its keyed answer is computed inside its transaction),
    bob's write through the same replica commits, and alice's next write, through another replica, waits on
    her advisory lock until the first commits; her writes commit in order."""
    from kvmem.text.keyed_writes import ReceiptClaim

    one, two = _open(pg_url), _open(pg_url)
    inside, release = threading.Event(), threading.Event()

    def held(view):
        inside.set()
        release.wait(30)
        return 201, {"ids": view.event_ids("added", "alice")}

    def first() -> None:
        with one.keyed_write(ReceiptClaim("alice", "POST /x", "k", "f", held, now_s=0.0, ttl_s=60.0)):
            one.add("alice", "first")

    def add(store: MemoryStore, user: str, text: str) -> threading.Thread:
        thread = threading.Thread(target=store.add, args=(user, text))
        thread.start()
        return thread

    opened = threading.Thread(target=first)
    opened.start()
    try:
        assert inside.wait(30)  # alice's transaction is open, her lock held
        bob = add(one, "bob", "bob's note")
        bob.join(30)
        assert not bob.is_alive() and [m.text for m in two.list("bob").items] == ["bob's note"]
        second = add(two, "alice", "second")
        waiting = 0
        for _ in range(300):  # bounded: until alice's second write waits on her advisory lock
            waiting = (
                two._conn()
                .execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted")
                .fetchone()[0]
            )
            if waiting:
                break
            threading.Event().wait(0.02)
        assert waiting == 1 and second.is_alive()
    finally:
        release.set()
        opened.join(30)
    second.join(30)
    assert [m.text for m in two.list("alice").items] == ["second", "first"]  # newest first
    one.close()
    two.close()


def test_a_nul_character_is_refused_as_input_naming_the_line_of_a_dump(tmp_path, pg_url):
    """PostgreSQL cannot hold U+0000 in a text (SQLite can): it was psycopg's DataError, a 500 over HTTP, and a
    SQLite dump holding one could not be imported, no line named. Nothing is stored either way."""
    import io

    from kvmem.text import InvalidMemoryInput

    with MemoryStore(tmp_path / "src.db", embedder=HashEmbedder()) as src:
        src.add("alice", texts=["I like tea", "I live in\x00 Lisbon."])
        dump = io.StringIO()
        src.export_jsonl(dump)
    with _open(pg_url) as store:
        nul = "a text holds a NUL character (U+0000), which the PostgreSQL store cannot hold"
        with pytest.raises(InvalidMemoryInput, match=r"^a text holds a NUL"):
            store.add("alice", texts=["I live in\x00 Lisbon."])
        with pytest.raises(InvalidMemoryInput) as refused:
            store.import_jsonl(io.StringIO(dump.getvalue()))
        assert str(refused.value) == f"line 2: {nul}"
        assert store.count_by_user() == {}
        store.add("alice", texts=["I live in Lisbon."])  # the store goes on
        assert store.count_by_user() == {"alice": 1}
