"""Database plumbing of the plaintext store: per-thread connections, write transactions, read snapshots.

Owns the connections to one SQLite file or one PostgreSQL database (pg.py's connections, which take the
same statements), the locks that serialize this process's writers (SQLite: one, as its file takes one writer at
a time; PostgreSQL: one per user, as replicas' writers lock per user, pg.begin_write; across processes:
SQLite's `BEGIN IMMEDIATE`, PostgreSQL's advisory locks), and the change-event subscribers that hear a write once it
is committed (DESIGN invariant 5). Knows nothing of the tables beyond what callers execute, nor of search or
embeddings.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import zlib
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from kvmem.text.config import TextStoreConfig
from kvmem.text.db import receipts
from kvmem.text.db.dialect import SQLITE, Dialect, is_postgres_url
from kvmem.text.errors import SubscriberError, TextStoreError
from kvmem.text.records import ChangeEvent

logger = logging.getLogger(__name__)


@dataclass
class Tx:
    """An open write transaction; `after_commit` runs while the write lock is still held."""

    conn: sqlite3.Connection
    events: list[ChangeEvent] = field(default_factory=list)
    after_commit: list[Callable[[], None]] = field(default_factory=list)


# PostgreSQL: this process's writes of different users run at once unless their users share a stripe
WRITE_LOCK_STRIPES = 64


class _WriteLocks:
    """This process's side of the write lock: re-entrant locks, one per stripe of users. A user's write holds
    its user's stripe; a write of no one user holds all of them, in order. One stripe: every write alone."""

    def __init__(self, num_stripes: int) -> None:
        self._stripes = [threading.RLock() for _ in range(num_stripes)]

    @contextmanager
    def hold(self, user_id: str | None) -> Iterator[None]:
        if user_id is None or len(self._stripes) == 1:
            held = self._stripes
        else:
            held = [self._stripes[zlib.crc32(user_id.encode("utf-8")) % len(self._stripes)]]
        with ExitStack() as stack:
            for lock in held:
                stack.enter_context(lock)
            yield


class Database:
    """One store file. Thread-safe: a connection per thread, since a transaction belongs to a connection
    and threads must not share one; writes serialized by a lock (on PostgreSQL, per user)."""

    def __init__(self, path: Path | str, config: TextStoreConfig) -> None:
        """`path`: the SQLite file, or a `postgresql://` URL (pg.is_postgres_url)."""
        self.path = path
        self._pg = None
        self.dialect: Dialect = SQLITE
        if isinstance(path, str):
            assert is_postgres_url(path), path
            try:
                from kvmem.text.db import pg  # psycopg is imported only where PostgreSQL is used
            except ImportError as e:
                raise TextStoreError(
                    f"the PostgreSQL store needs psycopg 3 ({e}); pip install 'kvmem[postgres]'"
                ) from e
            self._pg = pg
            self.dialect = pg.POSTGRES
        self._config = config
        self._local = threading.local()
        self._conns: list[sqlite3.Connection] = []
        self._conns_lock = threading.Lock()
        self._write_locks = _WriteLocks(WRITE_LOCK_STRIPES if self._pg is not None else 1)
        self._subscribers: list[Callable[[ChangeEvent], None]] = []
        self._subscribers_lock = threading.Lock()
        self._closed = False

    def conn(self) -> sqlite3.Connection:
        """This thread's connection, opened on first use; TextStoreError once the store is closed."""
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            return conn
        with self._conns_lock:
            if self._closed:
                raise TextStoreError(f"store {self.describe()} is closed")
            if self._pg is not None:
                conn = self._pg.PgConnection(self.path)
                self._conns.append(conn)
                self._local.conn = conn
                return conn
            conn = sqlite3.connect(
                self.path,
                isolation_level=None,
                check_same_thread=False,
                timeout=self._config.busy_timeout_ms / 1000,
            )
            conn.execute("PRAGMA journal_mode = WAL")
            conn.execute(f"PRAGMA synchronous = {self._config.synchronous}")
            conn.execute("PRAGMA foreign_keys = ON")
            conn.execute(f"PRAGMA busy_timeout = {self._config.busy_timeout_ms}")
            self._conns.append(conn)
        self._local.conn = conn
        return conn

    @contextmanager
    def write(self, user_id: str | None = None) -> Iterator[Tx]:
        """One write transaction; on any exception it rolls back and nothing is written or emitted.

        `user_id`: the one user whose rows it writes (on PostgreSQL it then waits only for that user's
        writes); None: any rows (it waits for every writer). After COMMIT the `after_commit` hooks run under
        the write lock (so a user's in-process caches change in commit order), then subscribers hear `events`
        before the caller's `with` block is left.
        """
        conn = self.conn()
        with self._write_locks.hold(user_id):
            if self._pg is not None:
                self._pg.begin_write(conn, user_id)
            else:
                conn.execute("BEGIN IMMEDIATE")
            tx = Tx(conn)
            claim = getattr(self._local, "claim", None)
            if claim is not None and claim.receipt is not None:
                claim = None  # recorded by an earlier transaction of the same call
            try:
                yield tx
                receipt = None if claim is None else receipts.record_receipt(conn, claim, tx.events)
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")
            if claim is not None:
                claim.receipt = receipt
            for hook in tx.after_commit:
                hook()
        self._emit(tx.events)

    @contextmanager
    def receipt(self, claim: receipts.ReceiptClaim) -> Iterator[receipts.ReceiptClaim]:
        """The first write transaction this thread commits inside the block records `claim`'s receipt in that
        same transaction (receipts.py); one that finds a live receipt of the key rolls back and raises
        receipts.ReceiptTaken. `claim.receipt` is None after the block if no write transaction committed."""
        assert getattr(self._local, "claim", None) is None, "receipt blocks do not nest"
        self._local.claim = claim
        try:
            yield claim
        finally:
            self._local.claim = None

    @contextmanager
    def snapshot(self) -> Iterator[sqlite3.Connection]:
        """A read transaction: every query inside sees the same committed state."""
        conn = self.conn()
        if self._pg is not None:
            self._pg.begin_read(conn)
        else:
            conn.execute("BEGIN")
        try:
            yield conn
        finally:
            conn.execute("COMMIT")

    def describe(self) -> str:
        """The file's path, or the PostgreSQL URL without its password (for messages)."""
        return self._pg.redact(self.path) if self._pg is not None else str(self.path)

    def close(self) -> None:
        """Closes every connection opened here; later calls to `conn` raise TextStoreError."""
        with self._conns_lock:
            self._closed = True
            conns, self._conns = self._conns, []
        for conn in conns:
            conn.close()
        self._local = threading.local()

    # ----------------------------------------------------------------- events

    def subscribe(self, callback: Callable[[ChangeEvent], None]) -> Callable[[], None]:
        """Calls `callback(event)` for every change, synchronously after commit; returns an unsubscribe."""
        with self._subscribers_lock:
            self._subscribers.append(callback)

        def unsubscribe() -> None:
            with self._subscribers_lock:
                if callback in self._subscribers:
                    self._subscribers.remove(callback)

        return unsubscribe

    def _emit(self, events: list[ChangeEvent]) -> None:
        if not events:
            return
        with self._subscribers_lock:
            subscribers = list(self._subscribers)
        errors: list[BaseException] = []
        for event in events:
            for callback in subscribers:
                try:
                    callback(event)
                except Exception as exc:  # every subscriber still hears every event; reported below
                    logger.exception("change-event subscriber %r failed on %s", callback, event)
                    errors.append(exc)
        if errors:
            raise SubscriberError(
                f"{len(errors)} subscriber call(s) failed after the write was committed: {errors[0]!r}"
            ) from errors[0]
