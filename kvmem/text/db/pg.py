"""The PostgreSQL side of the plaintext store: connections (psycopg 3) that accept the store's SQLite-style
statements, and PostgreSQL's dialect (dialect.py's interface).

Owns turning `?` placeholders into psycopg's, reconnecting after the server went away (StoreUnavailable for
the call that hit it, a fresh connection for the next), the write lock every replica shares (a transaction-
scoped advisory lock per user, so one user's writers serialize as SQLite's `BEGIN IMMEDIATE` makes them, while
different users' writes run at once), and the keyword index as a
term table `memory_terms(user_id, term, rowid, tf)` filled with FTS5's own stems (terms.py), so per-user
BM25 scores match SQLite's. Knows nothing of the store's operations; psycopg is imported here only.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from typing import Any

import psycopg
from psycopg import conninfo

from kvmem.text.db.dialect import is_postgres_url  # noqa: F401  (re-exported: pg.is_postgres_url)
from kvmem.text.errors import InvalidMemoryInput, StoreUnavailable
from kvmem.text.search.terms import query_tokens, term_counts

logger = logging.getLogger(__name__)

# pg_advisory_xact_lock keys (any fixed 64-bit numbers; the same in every replica). A user's write holds
# WRITE_LOCK_KEY shared and its user's key (user_lock_key) exclusive; a write of no one user (the embedder's
# bookkeeping, an import, pruning receipts) holds WRITE_LOCK_KEY exclusive, so it waits for every user's.
WRITE_LOCK_KEY = 0x6B766D656D5F7700  # "kvmem_w\0"
MIGRATE_LOCK_KEY = 0x6B766D656D5F6D00  # "kvmem_m\0"
_CONNECT_TIMEOUT_S = 5


def server_address(url: str) -> str:
    """host:port of a PostgreSQL URL (the default port 5432 when it names none); never the password."""
    try:
        params = conninfo.conninfo_to_dict(url)
    except psycopg.ProgrammingError as e:
        raise ValueError(f"not a valid PostgreSQL URL: {redact(url)} ({e})") from None
    host = params.get("host") or "localhost"
    return f"{host}:{params.get('port') or 5432}"


def redact(url: str) -> str:
    """The URL with any password replaced by ***."""
    try:
        params = conninfo.conninfo_to_dict(url)
    except psycopg.ProgrammingError:
        return "postgresql://(unparsable URL)"
    password = params.get("password")
    return url.replace(f":{password}@", ":***@") if password else url


@functools.lru_cache(maxsize=2048)
def to_pyformat(sql: str) -> str:
    """A statement written for sqlite3 (`?` placeholders) in psycopg's style: `?` outside quotes becomes
    `%s`, a literal `%` becomes `%%`."""
    out: list[str] = []
    quoted = False
    for ch in sql:
        if ch == "'":
            quoted = not quoted
            out.append(ch)
        elif ch == "%":
            out.append("%%")
        elif ch == "?" and not quoted:
            out.append("%s")
        else:
            out.append(ch)
    return "".join(out)


class PgCursor:
    """A statement's result with sqlite3's cursor surface: fetchone/fetchall/iteration give tuples, and a
    statement that returns no rows fetches None / []."""

    def __init__(self, cursor: psycopg.Cursor) -> None:
        self._cursor = cursor
        self.rowcount = cursor.rowcount

    def fetchone(self) -> tuple | None:
        return self._cursor.fetchone() if self._cursor.description is not None else None

    def fetchall(self) -> list[tuple]:
        return self._cursor.fetchall() if self._cursor.description is not None else []

    def __iter__(self):
        return iter(self.fetchall())


class PgConnection:
    """One psycopg connection (autocommit; transactions are begun explicitly, as on sqlite3) with sqlite3's
    `execute`/`executemany`. Not shared between threads (db.Database keeps one per thread).

    The server going away raises StoreUnavailable; nothing of an open transaction was committed. The next
    statement after that, or a BEGIN or a read outside a transaction that hits a connection found dead,
    opens a fresh connection first, so the store recovers by itself once the server is back.
    """

    def __init__(self, url: str) -> None:
        self.url = url
        self.where = server_address(url)
        self.dialect = POSTGRES
        self._raw: psycopg.Connection | None = None
        self._tx_open = False
        self._raw = self._connect()

    def _connect(self) -> psycopg.Connection:
        kwargs = {} if "connect_timeout" in self.url else {"connect_timeout": _CONNECT_TIMEOUT_S}
        try:
            return psycopg.connect(self.url, autocommit=True, **kwargs)
        except psycopg.OperationalError as e:
            raise self._unavailable(e) from None

    def _unavailable(self, exc: BaseException) -> StoreUnavailable:
        reason = " ".join(str(exc).split())
        password = conninfo.conninfo_to_dict(self.url).get("password")
        if password:
            reason = reason.replace(password, "***")
        return StoreUnavailable("postgresql", self.where, reason)

    @property
    def broken(self) -> bool:
        return self._raw is None or self._raw.broken or self._raw.closed

    @property
    def in_transaction(self) -> bool:
        """Whether a BEGIN issued here has not been ended by COMMIT or ROLLBACK yet (also when the
        connection broke meanwhile: the transaction is lost, and only ROLLBACK may follow)."""
        return self._tx_open

    def execute(self, sql: str, params: Any = ()) -> PgCursor:
        verb = sql.lstrip()[:8].upper()
        ends = verb.startswith(("COMMIT", "ROLLBACK", "END"))
        if self.broken and self._tx_open:
            # the server dropped the transaction with the connection: a ROLLBACK has nothing left to undo,
            # anything else must fail (running it on a fresh connection would commit half a transaction)
            self._tx_open = not ends
            if verb.startswith("ROLLBACK"):
                return PgCursor(_EMPTY)
            raise self._unavailable("the connection was lost during a transaction")
        if self.broken:
            self._reopen()  # nothing in flight: a fresh connection (StoreUnavailable if still away)
        # Repeatable after a lost connection, because nothing of it can have happened: BEGIN, and reads
        # outside a transaction (the first statement after the server came back finds the old socket dead)
        retry = not self._tx_open and verb.startswith(("BEGIN", "SELECT"))
        try:
            cursor = self._run(sql, params)
        except psycopg.OperationalError as e:
            if ends:
                self._tx_open = False
            if not self.broken:
                raise
            if not retry:
                raise self._unavailable(e) from None
            logger.warning("postgresql at %s: connection lost (%s); reconnecting", self.where, e)
            self._reopen()
            try:
                cursor = self._run(sql, params)
            except psycopg.OperationalError as e2:
                if self.broken:
                    raise self._unavailable(e2) from None
                raise
        if verb.startswith("BEGIN"):
            self._tx_open = True
        elif ends:
            self._tx_open = False
        return cursor

    def _run(self, sql: str, params: Any) -> PgCursor:
        cursor = self._raw.cursor()
        try:
            cursor.execute(to_pyformat(sql) if params else sql, params or None)
        except psycopg.DataError as e:
            raise _refused(e) from None
        return PgCursor(cursor)

    def executemany(self, sql: str, seq: Any) -> PgCursor:
        try:
            with self._raw.cursor() as cursor:
                cursor.executemany(to_pyformat(sql), list(seq))
                return PgCursor(_EMPTY)
        except psycopg.DataError as e:
            raise _refused(e) from None
        except psycopg.OperationalError as e:
            if self.broken:
                raise self._unavailable(e) from None
            raise

    def _reopen(self) -> None:
        if self._raw is not None:
            self._raw.close()
            self._raw = None
        self._raw = self._connect()

    def close(self) -> None:
        if self._raw is not None:
            self._raw.close()


def _refused(exc: psycopg.DataError) -> Exception:
    """A value PostgreSQL cannot hold as the input's fault (a 400, the transaction rolled back), where SQLite
    holds it: a NUL character in a text; any other data error as it is."""
    if "NUL" in str(exc):
        return InvalidMemoryInput(
            "a text holds a NUL character (U+0000), which the PostgreSQL store cannot hold"
        )
    return exc


class _Empty:
    description = None
    rowcount = -1


_EMPTY: Any = _Empty()


class PostgresDialect:
    """The keyword index is `memory_terms`; JSON filters use jsonb; writers take advisory locks (begin_write)."""

    name = "postgresql"
    terms_table = "memory_terms"

    def index_text(self, conn: PgConnection, rowid: int, user_id: str, text: str) -> None:
        counts = term_counts([text])[0]
        if counts:
            conn.executemany(
                "INSERT INTO memory_terms (user_id, term, rowid, tf) VALUES (?, ?, ?, ?)",
                [(user_id, term, rowid, tf) for term, tf in counts.items()],
            )

    def reindex_text(self, conn: PgConnection, rowid: int, user_id: str, text: str) -> None:
        conn.execute("DELETE FROM memory_terms WHERE rowid = ?", (rowid,))
        self.index_text(conn, rowid, user_id, text)

    def term_frequencies(self, conn: PgConnection, user_id: str, term: str) -> tuple[list[int], list[int]]:
        """(rowids, term frequencies) of the user's rows holding `term` after FTS5's stemming. A word FTS5
        splits into several tokens ('a_b', a phrase there) matches rows holding all of them, with the least
        of their frequencies (FTS5 wants them adjacent: the one place the two stores can differ)."""
        tokens = query_tokens(term)
        if not tokens:
            return [], []
        if len(tokens) == 1:
            rows = conn.execute(
                "SELECT rowid, tf FROM memory_terms WHERE user_id = ? AND term = ?", (user_id, tokens[0])
            ).fetchall()
        else:
            marks = ",".join("?" * len(tokens))
            rows = conn.execute(
                f"SELECT rowid, min(tf) FROM memory_terms WHERE user_id = ? AND term IN ({marks}) "
                "GROUP BY rowid HAVING count(*) = ?",
                (user_id, *tokens, len(tokens)),
            ).fetchall()
        return [r[0] for r in rows], [r[1] for r in rows]

    def tag_clause(self) -> str:
        return "EXISTS (SELECT 1 FROM jsonb_array_elements_text(m.tags::jsonb) t(value) WHERE t.value = ?)"

    def metadata_clause(self, key: str, value: Any) -> tuple[str, list[Any]]:
        """Exact equality on one top-level metadata key, by JSON type (so True never matches 1)."""
        base = "EXISTS (SELECT 1 FROM jsonb_each(m.metadata::jsonb) j WHERE j.key = ? AND "
        if value is None:
            return base + "jsonb_typeof(j.value) = 'null')", [key]
        if isinstance(value, bool):
            return base + "j.value = ?::jsonb)", [key, "true" if value else "false"]
        if isinstance(value, (int, float)):
            return (
                base + "jsonb_typeof(j.value) = 'number' AND (j.value #>> '{}')::numeric = ?::numeric)",
                [key, value],
            )
        return base + "jsonb_typeof(j.value) = 'string' AND j.value #>> '{}' = ?)", [key, value]


POSTGRES = PostgresDialect()


def user_lock_key(user_id: str) -> int:
    """The advisory lock key of a user's writes: 64 bits of a digest of the id (two users that share one only
    wait for each other)."""
    digest = hashlib.blake2b(user_id.encode("utf-8"), digest_size=8, person=b"kvmem-user-lock").digest()
    return int.from_bytes(digest, "big", signed=True)


def begin_write(conn: PgConnection, user_id: str | None = None) -> None:
    """BEGIN, then the advisory locks every replica's writers take (held until COMMIT or ROLLBACK): a user's
    write waits only for that user's other writes (and for a write of no user), so one user's writes are
    serialized, in one commit order, as on SQLite; `user_id` None: a write of no one user, alone."""
    conn.execute("BEGIN")
    if user_id is None:
        conn.execute("SELECT pg_advisory_xact_lock(?)", (WRITE_LOCK_KEY,))
        return
    conn.execute("SELECT pg_advisory_xact_lock_shared(?)", (WRITE_LOCK_KEY,))
    conn.execute("SELECT pg_advisory_xact_lock(?)", (user_lock_key(user_id),))


def begin_read(conn: PgConnection) -> None:
    """A snapshot: every statement until COMMIT sees the same committed state."""
    conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
