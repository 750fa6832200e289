"""The conversation log's row statements: the `turns` table, apart from memories.

Owns the column list, row -> Turn, and every statement on `turns` (append, page, the formation queue's
reads and state changes, deletes by id, session or user). Each function runs on a connection its caller
holds (inside a transaction for writes) and takes the user id, so no statement touches another user's turns;
knows nothing of locks, validation, memories or formation itself.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable
from typing import Any

from kvmem.text.records import FormationCounts, Turn

TURN_COLUMNS = (
    "t.id, t.user_id, t.session_id, t.role, t.speaker, t.text, t.chat_time, t.created_at, t.formation, "
    "t.attempts, t.error, t.updated_at"
)
MAX_ERROR_CHARS = 500  # a failure's error text is kept to this many characters
_ID_CHUNK = 500  # ids per `IN (...)`, well under SQLite's default limit of bound parameters
_NEWEST_FIRST = "ORDER BY t.chat_time DESC, t.rowid DESC"
_OLDEST_FIRST = "ORDER BY t.chat_time, t.rowid"


def row_to_turn(row: tuple) -> Turn:
    """A Turn from the values of TURN_COLUMNS, in order."""
    return Turn(*row)


def insert_turns(
    conn: sqlite3.Connection,
    turns: list[Turn],
    reply_to: str | None = None,
    used_memory_ids: Iterable[str] = (),
) -> None:
    """Appends these turns to the log, in order (rowids grow, so insertion order breaks chat_time ties); each
    answers the turn `reply_to` if given, and was generated with the memories `used_memory_ids`."""
    conn.executemany(
        "INSERT INTO turns (id, user_id, session_id, role, speaker, text, chat_time, created_at, formation, "
        "attempts, error, updated_at, reply_to) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        [
            (
                t.id,
                t.user_id,
                t.session_id,
                t.role,
                t.speaker,
                t.text,
                t.chat_time,
                t.created_at,
                t.formation,
                t.attempts,
                t.error,
                t.updated_at,
                reply_to,
            )
            for t in turns
        ],
    )
    used = list(dict.fromkeys(used_memory_ids))
    if used:
        conn.executemany(
            "INSERT INTO turn_uses (turn_id, user_id, memory_id) VALUES (?, ?, ?)",
            [(t.id, t.user_id, memory_id) for t in turns for memory_id in used],
        )


def _select_ids(conn: sqlite3.Connection, sql: str, user_id: str, ids: Iterable[str]) -> list[str]:
    """The first column of `sql` (which ends in `IN (` and takes the user id first) over `ids`, in chunks."""
    ids = list(dict.fromkeys(ids))
    found: list[str] = []
    for start in range(0, len(ids), _ID_CHUNK):
        chunk = ids[start : start + _ID_CHUNK]
        found.extend(r[0] for r in conn.execute(f"{sql}{','.join('?' * len(chunk))})", (user_id, *chunk)))
    return list(dict.fromkeys(found))


def replies_to(conn: sqlite3.Connection, user_id: str, turn_ids: Iterable[str]) -> list[str]:
    """This user's turns logged as replies to any of `turn_ids`."""
    return _select_ids(conn, "SELECT id FROM turns WHERE user_id = ? AND reply_to IN (", user_id, turn_ids)


def turns_using(conn: sqlite3.Connection, user_id: str, memory_ids: Iterable[str]) -> list[str]:
    """This user's turns (replies) generated with any of `memory_ids`."""
    return _select_ids(
        conn, "SELECT turn_id FROM turn_uses WHERE user_id = ? AND memory_id IN (", user_id, memory_ids
    )


def session_erased_generation(conn: sqlite3.Connection, user_id: str, session_id: str) -> int:
    """The user's generation at which this session of theirs was last deleted; 0 if never."""
    row = conn.execute(
        "SELECT erased_gen FROM erased_sessions WHERE user_id = ? AND session_id = ?", (user_id, session_id)
    ).fetchone()
    return int(row[0]) if row else 0


def mark_session_erased(conn: sqlite3.Connection, user_id: str, session_id: str, generation: int) -> None:
    """Records that this session of the user was deleted at `generation` (session_erased_generation)."""
    conn.execute(
        "INSERT INTO erased_sessions (user_id, session_id, erased_gen) VALUES (?, ?, ?) "
        "ON CONFLICT (user_id, session_id) DO UPDATE SET erased_gen = excluded.erased_gen",
        (user_id, session_id, generation),
    )


def page_turns(
    conn: sqlite3.Connection,
    user_id: str,
    session_id: str | None,
    limit: int,
    offset: int,
    start: str | None = None,
    end: str | None = None,
) -> tuple[list[Turn], int]:
    """(one page of this user's turns, newest first; how many the listing holds), one session's if given,
    said in [start, end] if given (ISO times, as stored)."""
    where, params = "t.user_id = ?", [user_id]
    if session_id is not None:
        where, params = where + " AND t.session_id = ?", [*params, session_id]
    if start is not None:
        where, params = where + " AND t.chat_time >= ?", [*params, start]
    if end is not None:
        where, params = where + " AND t.chat_time <= ?", [*params, end]
    total = conn.execute(f"SELECT count(*) FROM turns t WHERE {where}", params).fetchone()[0]
    rows = conn.execute(
        f"SELECT {TURN_COLUMNS} FROM turns t WHERE {where} {_NEWEST_FIRST} LIMIT ? OFFSET ?",
        [*params, limit, offset],
    ).fetchall()
    return [row_to_turn(r) for r in rows], total


def turns_in_state(conn: sqlite3.Connection, user_id: str, formation: str, limit: int) -> list[Turn]:
    """This user's first `limit` turns in this formation state, oldest first (chat_time, then insertion)."""
    rows = conn.execute(
        f"SELECT {TURN_COLUMNS} FROM turns t WHERE t.user_id = ? AND t.formation = ? {_OLDEST_FIRST} LIMIT ?",
        (user_id, formation, limit),
    ).fetchall()
    return [row_to_turn(r) for r in rows]


def users_with_pending(conn: sqlite3.Connection) -> list[str]:
    """Every user with at least one pending turn, sorted (an operator view: it names all users)."""
    return [
        r[0]
        for r in conn.execute(
            "SELECT DISTINCT user_id FROM turns WHERE formation = 'pending' ORDER BY user_id"
        )
    ]


def count_states(conn: sqlite3.Connection, user_id: str | None) -> FormationCounts:
    """Pending and dead turns of one user, or of all users (None)."""
    where, params = ("user_id = ? AND ", [user_id]) if user_id is not None else ("", [])
    counts = dict(
        conn.execute(
            f"SELECT formation, count(*) FROM turns WHERE {where}formation IN ('pending', 'dead') "
            "GROUP BY formation",
            params,
        ).fetchall()
    )
    return FormationCounts(pending=counts.get("pending", 0), dead=counts.get("dead", 0))


def existing_turn_ids(conn: sqlite3.Connection, user_id: str, ids: Iterable[str]) -> set[str]:
    """Which of these ids are turns of this user (in any formation state)."""
    ids = list(dict.fromkeys(ids))
    found: set[str] = set()
    for start in range(0, len(ids), _ID_CHUNK):
        chunk = ids[start : start + _ID_CHUNK]
        found.update(
            r[0]
            for r in conn.execute(
                f"SELECT id FROM turns WHERE user_id = ? AND id IN ({','.join('?' * len(chunk))})",
                (user_id, *chunk),
            )
        )
    return found


def cited_texts(conn: sqlite3.Connection, user_id: str, cited: list[Iterable[str]]) -> list[list[str]]:
    """For each list of turn ids in `cited`, the texts of those that are still turns of this user, in order."""
    cited = [list(ids) for ids in cited]
    ids = list(dict.fromkeys(t for group in cited for t in group))
    found: dict[str, str] = {}
    for start in range(0, len(ids), _ID_CHUNK):
        chunk = ids[start : start + _ID_CHUNK]
        found.update(
            conn.execute(
                f"SELECT id, text FROM turns WHERE user_id = ? AND id IN ({','.join('?' * len(chunk))})",
                (user_id, *chunk),
            ).fetchall()
        )
    return [[found[t] for t in group if t in found] for group in cited]


def _update_ids(
    conn: sqlite3.Connection, user_id: str, ids: list[str], assignments: str, where: str, params: list[Any]
) -> int:
    """Runs `UPDATE turns SET assignments` over this user's turns among `ids` that match `where`; returns
    how many rows changed."""
    changed = 0
    ids = list(dict.fromkeys(ids))
    for start in range(0, len(ids), _ID_CHUNK):
        chunk = ids[start : start + _ID_CHUNK]
        changed += conn.execute(
            f"UPDATE turns SET {assignments} WHERE user_id = ? AND {where} "
            f"AND id IN ({','.join('?' * len(chunk))})",
            (*params, user_id, *chunk),
        ).rowcount
    return changed


def fail(conn: sqlite3.Connection, user_id: str, ids: list[str], error: str, dead: bool, now: str) -> int:
    """Records a failed formation attempt on this user's pending turns among `ids`: attempts + 1, the error
    (its first MAX_ERROR_CHARS characters), 'dead' if `dead`; returns how many turns it touched."""
    return _update_ids(
        conn,
        user_id,
        ids,
        "attempts = attempts + 1, error = ?, formation = ?, updated_at = ?",
        "formation = 'pending'",
        [error[:MAX_ERROR_CHARS], "dead" if dead else "pending", now],
    )


def mark_formed(conn: sqlite3.Connection, user_id: str, ids: list[str], now: str) -> int:
    """This user's pending or dead turns among `ids` become 'formed'; returns how many."""
    return _update_ids(
        conn, user_id, ids, "formation = 'formed', updated_at = ?", "formation IN ('pending', 'dead')", [now]
    )


def requeue_dead(conn: sqlite3.Connection, user_id: str | None, now: str) -> int:
    """This user's dead turns (every user's: None) go back to 'pending' with attempts 0 and no error; returns
    how many."""
    where, params = ("user_id = ? AND ", [user_id]) if user_id is not None else ("", [])
    return conn.execute(
        "UPDATE turns SET formation = 'pending', attempts = 0, error = NULL, updated_at = ? "
        f"WHERE {where}formation = 'dead'",
        (now, *params),
    ).rowcount


def requeue(conn: sqlite3.Connection, user_id: str, ids: Iterable[str], now: str) -> int:
    """This user's turns among `ids`, in any state, go back to 'pending' with attempts 0 and no error (formed
    again by the next pass); returns how many."""
    return _update_ids(
        conn,
        user_id,
        list(ids),
        "formation = 'pending', attempts = 0, error = NULL, updated_at = ?",
        "1 = 1",
        [now],
    )


def delete_turn_ids(conn: sqlite3.Connection, user_id: str, ids: Iterable[str]) -> int:
    """Hard-deletes this user's turns among `ids`; returns how many."""
    ids = list(dict.fromkeys(ids))
    deleted = 0
    for start in range(0, len(ids), _ID_CHUNK):
        chunk = ids[start : start + _ID_CHUNK]
        deleted += conn.execute(
            f"DELETE FROM turns WHERE user_id = ? AND id IN ({','.join('?' * len(chunk))})",
            (user_id, *chunk),
        ).rowcount
    return deleted


def delete_turns_where(conn: sqlite3.Connection, user_id: str, session_id: str | None) -> int:
    """Hard-deletes this user's turns of one session, or all of them (session_id None); returns how many."""
    if session_id is None:
        return conn.execute("DELETE FROM turns WHERE user_id = ?", (user_id,)).rowcount
    return conn.execute(
        "DELETE FROM turns WHERE user_id = ? AND session_id = ?", (user_id, session_id)
    ).rowcount
