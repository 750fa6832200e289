"""How a Memory maps onto the store's tables, and the multi-table statements that keep them in step.

Owns the column list, row -> Memory, and the writes that must touch `memories`, the keyword index
(`memories_fts` on SQLite, `memory_terms` on PostgreSQL: dialect.py),
`memory_vectors`, `memory_versions` and `user_generation` together (supersession included). The log's
`turns` table is turns.py's. Every function runs on a connection
its caller holds inside a transaction; knows nothing of locks, events, caches or validation.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from typing import Any, NamedTuple

import numpy as np

from kvmem.text.db.dialect import dialect_of
from kvmem.text.records import Memory, MemoryVersion

# The memories columns in Memory's field order, over the table aliased `m`.
COLUMNS = (
    "m.id, m.user_id, m.session_id, m.agent_id, m.role, m.text, m.created_at, m.chat_time, "
    "m.updated_at, m.tags, m.metadata, m.state, m.version, m.valid_from, m.valid_to, m.superseded_by, "
    "m.source, m.source_turn_ids, m.slot, m.slot_value"
)
NUM_COLUMNS = 20
# Deleted memories keep a tombstone row (see `tombstone`); every read of live memories adds this condition.
LIVE = "m.state != 'deleted'"
# A superseded memory keeps its row with valid_to set; reads of what is served add this condition.
CURRENT = "m.valid_to IS NULL"
SERVED = f"m.state = 'active' AND {CURRENT}"
_ID_CHUNK = 500  # ids per `IN (...)`, well under SQLite's default limit of bound parameters


def row_to_memory(row: tuple) -> Memory:
    """A Memory from the NUM_COLUMNS values of COLUMNS, in order."""
    return Memory(
        id=row[0],
        user_id=row[1],
        session_id=row[2],
        agent_id=row[3],
        role=row[4],
        text=row[5],
        created_at=row[6],
        chat_time=row[7],
        updated_at=row[8],
        tags=tuple(json.loads(row[9])),
        metadata=json.loads(row[10]),
        state=row[11],
        version=row[12],
        valid_from=row[13],
        valid_to=row[14],
        superseded_by=row[15],
        source=row[16],
        source_turn_ids=tuple(json.loads(row[17])),
        slot=row[18],
        slot_value=row[19],
    )


class StoredMemory(NamedTuple):
    """A memory with its rowid, the key of its FTS, vector and history rows."""

    rowid: int
    memory: Memory


def find_live(conn: Any, user_id: str, memory_id: str) -> StoredMemory | None:
    """The live memory `memory_id` of `user_id`, or None if absent, deleted or another user's."""
    row = conn.execute(
        f"SELECT m.rowid, {COLUMNS} FROM memories m WHERE m.id = ? AND m.user_id = ? AND {LIVE}",
        (memory_id, user_id),
    ).fetchone()
    return None if row is None else StoredMemory(row[0], row_to_memory(row[1:]))


def to_json(value: Any) -> str:
    """Tags and metadata as stored: compact JSON, non-ASCII kept as is."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def insert_memory(conn: Any, memory: Memory, vector: bytes | None) -> int:
    """Inserts the memory with its FTS row (tagged with the owner token) and its vector; returns its rowid.

    A memory without valid_from is written with its chat_time as valid_from.
    """
    rowid = conn.execute(
        "INSERT INTO memories (id, user_id, session_id, agent_id, role, text, created_at, chat_time, "
        "updated_at, tags, metadata, state, version, valid_from, valid_to, superseded_by, source, "
        "source_turn_ids, slot, slot_value) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "
        "RETURNING rowid",
        (
            memory.id,
            memory.user_id,
            memory.session_id,
            memory.agent_id,
            memory.role,
            memory.text,
            memory.created_at,
            memory.chat_time,
            memory.updated_at,
            to_json(list(memory.tags)),
            to_json(memory.metadata),
            memory.state,
            memory.version,
            memory.valid_from or memory.chat_time,
            memory.valid_to,
            memory.superseded_by,
            memory.source,
            to_json(list(memory.source_turn_ids)),
            memory.slot,
            memory.slot_value,
        ),
    ).fetchone()[0]
    dialect_of(conn).index_text(conn, rowid, memory.user_id, memory.text)
    if vector is not None:
        conn.execute(
            "INSERT INTO memory_vectors (rowid, user_id, vec) VALUES (?, ?, ?)",
            (rowid, memory.user_id, vector),
        )
    return rowid


def insert_history(conn: Any, rowid: int, history: Iterable[MemoryVersion]) -> None:
    """Stores previous versions of the memory at `rowid` (a dump's history, loaded as it was)."""
    conn.executemany(
        "INSERT INTO memory_versions (memory_rowid, version, text, tags, metadata, updated_at) "
        "VALUES (?, ?, ?, ?, ?, ?)",
        [
            (rowid, v.version, v.text, to_json(list(v.tags)), to_json(v.metadata), v.updated_at)
            for v in history
        ],
    )


def read_versions(conn: Any, rowid: int) -> list[MemoryVersion]:
    """Previous versions of the memory at `rowid`, oldest first."""
    rows = conn.execute(
        "SELECT version, text, tags, metadata, updated_at FROM memory_versions "
        "WHERE memory_rowid = ? ORDER BY version",
        (rowid,),
    ).fetchall()
    return [
        MemoryVersion(
            version=r[0],
            text=r[1],
            tags=tuple(json.loads(r[2])),
            metadata=json.loads(r[3]),
            updated_at=r[4],
        )
        for r in rows
    ]


def write_version(conn: Any, rowid: int, old: Memory, new: Memory, vector: np.ndarray | None) -> None:
    """Moves `old`'s text, tags and metadata to history and writes `new` over the row (its slot too); when
    the text changed, the FTS row and the vector (`vector`, the new text's) follow."""
    conn.execute(
        "INSERT INTO memory_versions (memory_rowid, version, text, tags, metadata, updated_at) "
        "VALUES (?, ?, ?, ?, ?, ?)",
        (rowid, old.version, old.text, to_json(list(old.tags)), to_json(old.metadata), old.updated_at),
    )
    conn.execute(
        "UPDATE memories SET text = ?, tags = ?, metadata = ?, state = ?, version = ?, updated_at = ?, "
        "slot = ?, slot_value = ? WHERE rowid = ?",
        (
            new.text,
            to_json(list(new.tags)),
            to_json(new.metadata),
            new.state,
            new.version,
            new.updated_at,
            new.slot,
            new.slot_value,
            rowid,
        ),
    )
    if new.text != old.text:
        assert vector is not None, "a new text needs its vector"
        dialect_of(conn).reindex_text(conn, rowid, new.user_id, new.text)
        conn.execute("UPDATE memory_vectors SET vec = ? WHERE rowid = ?", (vector.tobytes(), rowid))


def live_ids(conn: Any, user_id: str, where: str, params: list[Any]) -> list[str]:
    """Ids of this user's live memories matching `where` (a condition over `m`)."""
    return [
        r[0]
        for r in conn.execute(
            f"SELECT m.id FROM memories m WHERE m.user_id = ? AND {LIVE} AND {where}", [user_id, *params]
        )
    ]


def source_turn_ids(conn: Any, user_id: str, where: str, params: list[Any]) -> list[str]:
    """The log turns this user's live memories matching `where` were formed from (distinct, in order)."""
    ids: dict[str, None] = {}
    for (encoded,) in conn.execute(
        f"SELECT m.source_turn_ids FROM memories m WHERE m.user_id = ? AND {LIVE} AND {where} "
        "AND m.source_turn_ids != '[]' ORDER BY m.rowid",
        [user_id, *params],
    ):
        ids.update(dict.fromkeys(json.loads(encoded)))
    return list(ids)


def tombstone(conn: Any, user_id: str, where: str, params: list[Any], updated_at: str) -> None:
    """Turns this user's live memories matching `where` into tombstones: state 'deleted', text, tags,
    metadata, slot, slot value, provenance, history, FTS rows and vectors erased, version bumped."""
    selection = f"SELECT m.rowid FROM memories m WHERE m.user_id = ? AND {LIVE} AND {where}"
    args = [user_id, *params]
    for table, column in (
        ("memory_versions", "memory_rowid"),
        (dialect_of(conn).terms_table, "rowid"),
        ("memory_vectors", "rowid"),
    ):
        conn.execute(f"DELETE FROM {table} WHERE {column} IN ({selection})", args)
    conn.execute(
        f"UPDATE memories SET state = 'deleted', text = '', tags = '[]', metadata = '{{}}', slot = NULL, "
        f"slot_value = NULL, source_turn_ids = '[]', version = version + 1, updated_at = ? "
        f"WHERE rowid IN ({selection})",
        [updated_at, *args],
    )


def existing_ids(conn: Any, ids: list[str]) -> set[str]:
    """Which of these ids the file already holds, in any state and for any user (ids are global)."""
    found: set[str] = set()
    for start in range(0, len(ids), _ID_CHUNK):
        chunk = ids[start : start + _ID_CHUNK]
        found.update(
            r[0]
            for r in conn.execute(
                f"SELECT id FROM memories WHERE id IN ({','.join('?' * len(chunk))})", chunk
            )
        )
    return found


def live_by_ids(
    conn: Any, user_id: str, ids: list[str], include_superseded: bool = True
) -> dict[str, Memory]:
    """This user's live memories among these (distinct) ids, by id; superseded ones only if asked."""
    live = LIVE if include_superseded else f"{LIVE} AND {CURRENT}"
    found: dict[str, Memory] = {}
    for start in range(0, len(ids), _ID_CHUNK):
        chunk = ids[start : start + _ID_CHUNK]
        marks = ",".join("?" * len(chunk))
        for row in conn.execute(
            f"SELECT {COLUMNS} FROM memories m WHERE m.user_id = ? AND {live} AND m.id IN ({marks})",
            (user_id, *chunk),
        ):
            found[row[0]] = row_to_memory(row)
    return found


def active_by_rowids(
    conn: Any, user_id: str, rowids: list[int], include_superseded: bool = False
) -> dict[int, Memory]:
    """This user's served memories among these rowids (search hits), by rowid; with `include_superseded`,
    every active one.

    The rows are looked up by rowid and the user is checked here, not in SQL: with `m.user_id = ?` in the
    WHERE clause SQLite walked the user's whole `memories_by_user` range (10k rows: ~5 ms) to find 10 hits.
    """
    marks = ",".join("?" * len(rowids))
    active = "m.state = 'active'" if include_superseded else SERVED
    rows = conn.execute(
        f"SELECT m.rowid, {COLUMNS} FROM memories m WHERE m.rowid IN ({marks}) AND {active}",
        rowids,
    ).fetchall()
    return {r[0]: row_to_memory(r[1:]) for r in rows if r[2] == user_id}  # r[2]: m.user_id


def bump_generation(conn: Any, user_id: str) -> int:
    """Advances this user's generation, which retires every cached vector matrix of theirs; returns it."""
    return conn.execute(
        "INSERT INTO user_generation (user_id, gen) VALUES (?, 1) "
        "ON CONFLICT (user_id) DO UPDATE SET gen = user_generation.gen + 1 RETURNING gen",
        (user_id,),
    ).fetchone()[0]


def read_generation(conn: Any, user_id: str) -> int:
    """This user's generation (`bump_generation`); 0 for a user never written."""
    row = conn.execute("SELECT gen FROM user_generation WHERE user_id = ?", (user_id,)).fetchone()
    return int(row[0]) if row else 0


def mark_erased(conn: Any, user_id: str) -> int:
    """The user was wholly deleted (memories and log): advances their generation and records it as the one
    they were erased at (`erased_generation`); returns it."""
    gen = bump_generation(conn, user_id)
    conn.execute("UPDATE user_generation SET erased_gen = ? WHERE user_id = ?", (gen, user_id))
    return gen


def erased_generation(conn: Any, user_id: str) -> int:
    """The generation at which the user was last wholly deleted; 0 if never."""
    row = conn.execute("SELECT erased_gen FROM user_generation WHERE user_id = ?", (user_id,)).fetchone()
    return int(row[0]) if row else 0


def find_served(conn: Any, user_id: str, memory_id: str) -> StoredMemory | None:
    """The served (active, not superseded) memory `memory_id` of `user_id`, or None."""
    found = find_live(conn, user_id, memory_id)
    return found if found is not None and found.memory.is_served else None


def supersede_row(conn: Any, old: StoredMemory, new_id: str, valid_to: str, now: str) -> Memory:
    """Marks the served memory `old` superseded by `new_id` from `valid_to` on: a new version (the previous
    one goes to history, as an update's does) with valid_to and superseded_by set; returns it. The caller
    bumps the user's generation, so cached vector matrices drop the row."""
    rowid, memory = old
    assert memory.is_served, memory.id
    conn.execute(
        "INSERT INTO memory_versions (memory_rowid, version, text, tags, metadata, updated_at) "
        "VALUES (?, ?, ?, ?, ?, ?)",
        (
            rowid,
            memory.version,
            memory.text,
            to_json(list(memory.tags)),
            to_json(memory.metadata),
            memory.updated_at,
        ),
    )
    updated_at = max(now, memory.updated_at)
    conn.execute(
        "UPDATE memories SET valid_to = ?, superseded_by = ?, version = ?, updated_at = ? WHERE rowid = ?",
        (valid_to, new_id, memory.version + 1, updated_at, rowid),
    )
    return dataclasses.replace(
        memory, valid_to=valid_to, superseded_by=new_id, version=memory.version + 1, updated_at=updated_at
    )


def add_provenance(conn: Any, old: StoredMemory, turn_ids: Iterable[str]) -> Memory:
    """The memory `old` with these turn ids appended to its source_turn_ids (those it already cites kept
    once); no new version: what it says is unchanged."""
    rowid, memory = old
    merged = tuple(dict.fromkeys([*memory.source_turn_ids, *turn_ids]))
    if merged != memory.source_turn_ids:
        conn.execute(
            "UPDATE memories SET source_turn_ids = ? WHERE rowid = ?", (to_json(list(merged)), rowid)
        )
    return dataclasses.replace(memory, source_turn_ids=merged)
