"""What differs between the store's two databases, behind one small interface: SQLite's side here,
PostgreSQL's in pg.py.

Owns the statements that cannot be written once for both: the keyword index (SQLite: the FTS5 table
`memories_fts`; PostgreSQL: the term table `memory_terms`), the JSON filters (SQLite's json_each vs
PostgreSQL's jsonb functions) and how a write transaction begins. Every other statement is shared, written
with `?` placeholders (pg.py's connection translates). `dialect_of(conn)` picks by the connection, so the
row functions keep their `conn` argument. Knows nothing of the store's operations.
"""

from __future__ import annotations

import hashlib
import sqlite3
from typing import Any, Protocol

_MARK = "\x01"


class Dialect(Protocol):
    name: str
    terms_table: str  # the keyword index's table; its `rowid` column is the memory's rowid

    def index_text(self, conn: Any, rowid: int, user_id: str, text: str) -> None: ...

    def reindex_text(self, conn: Any, rowid: int, user_id: str, text: str) -> None: ...

    def term_frequencies(self, conn: Any, user_id: str, term: str) -> tuple[list[int], list[int]]: ...

    def tag_clause(self) -> str: ...

    def metadata_clause(self, key: str, value: Any) -> tuple[str, list[Any]]: ...


def owner_token(user_id: str) -> str:
    """The FTS5 token that tags a user's rows, so a MATCH can be restricted to one user inside the index."""
    return "u" + hashlib.sha256(user_id.encode("utf-8")).hexdigest()[:24]


class SqliteDialect:
    """FTS5 finds a term's rows (the owner token scopes them to the user) and counts its instances."""

    name = "sqlite"
    terms_table = "memories_fts"

    def index_text(self, conn: sqlite3.Connection, rowid: int, user_id: str, text: str) -> None:
        conn.execute(
            "INSERT INTO memories_fts (rowid, text, owner) VALUES (?, ?, ?)",
            (rowid, text, owner_token(user_id)),
        )

    def reindex_text(self, conn: sqlite3.Connection, rowid: int, user_id: str, text: str) -> None:
        conn.execute("UPDATE memories_fts SET text = ? WHERE rowid = ?", (text, rowid))

    def term_frequencies(
        self, conn: sqlite3.Connection, user_id: str, term: str
    ) -> tuple[list[int], list[int]]:
        """(rowids, term frequencies) of the user's FTS rows holding `term` (stemmed as FTS5 does).

        No join: the MATCH alone drives the query (a join let SQLite run the MATCH once per memory row).
        """
        expression = f'owner : "{owner_token(user_id)}" AND text : "' + term.replace('"', '""') + '"'
        rows = conn.execute(
            "SELECT rowid, highlight(memories_fts, 0, char(1), '') FROM memories_fts WHERE memories_fts MATCH ?",
            (expression,),
        ).fetchall()
        return [r[0] for r in rows], [max(1, r[1].count(_MARK)) for r in rows]

    def tag_clause(self) -> str:
        return "EXISTS (SELECT 1 FROM json_each(m.tags) t WHERE t.value = ?)"

    def metadata_clause(self, key: str, value: Any) -> tuple[str, list[Any]]:
        """Exact equality on one top-level metadata key, by JSON type (so True never matches 1)."""
        base = "EXISTS (SELECT 1 FROM json_each(m.metadata) j WHERE j.key = ? AND "
        if value is None:
            return base + "j.type = 'null')", [key]
        if isinstance(value, bool):
            return base + "j.type = ?)", [key, "true" if value else "false"]
        if isinstance(value, (int, float)):
            return base + "j.type IN ('integer', 'real') AND j.value = ?)", [key, value]
        return base + "j.type = 'text' AND j.value = ?)", [key, value]


SQLITE = SqliteDialect()


POSTGRES_URL_PREFIXES = ("postgresql://", "postgres://")


def is_postgres_url(location: object) -> bool:
    """Whether a store location names a PostgreSQL database (a `postgresql://` URL) rather than a file."""
    return isinstance(location, str) and location.startswith(POSTGRES_URL_PREFIXES)


def check_store_location(location: str) -> str:
    """A `--store` value: a `postgresql://user@host:port/db` URL, or a SQLite file path; anything else with a
    scheme (`mysql://`, `postgresql:/x`) is refused with ValueError naming it."""
    if not isinstance(location, str) or not location.strip():
        raise ValueError(f"store must be a postgresql:// URL or a SQLite file path, got {location!r}")
    if is_postgres_url(location):
        return location
    if "://" in location or location.lower().startswith(("postgres:", "postgresql:")):
        scheme = location.split(":", 1)[0]
        raise ValueError(
            f"store must be a postgresql://user@host:port/db URL or a SQLite file path, got a {scheme}: URL"
        )
    return location


def dialect_of(conn: Any) -> Dialect:
    """The dialect of a connection: pg.py's connections carry theirs; a sqlite3 connection is SQLite's."""
    return getattr(conn, "dialect", SQLITE)
