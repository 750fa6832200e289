"""Heat per (user, memory): exponentially decayed retrieval hits and uses, first seen, last access, last change.

Owns the statistics and their persistence (one SQLite table, no pickle; or, given a `postgresql://` URL,
the same tables in the PostgreSQL store's database, shared by replicas). Time is always passed in, so tests
control it. Knows nothing of blocks, plans or queues.
"""

from __future__ import annotations

import hashlib
import math
import sqlite3
import threading
from collections import OrderedDict
from collections.abc import Container, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

_SCHEMA = """
CREATE TABLE IF NOT EXISTS heat (
    user_id TEXT NOT NULL, memory_id TEXT NOT NULL, score REAL NOT NULL, score_at REAL NOT NULL,
    hits INTEGER NOT NULL, uses INTEGER NOT NULL, first_seen REAL NOT NULL, last_access REAL,
    last_change REAL NOT NULL, PRIMARY KEY (user_id, memory_id));
CREATE TABLE IF NOT EXISTS applied (
    user_id TEXT NOT NULL, event_key TEXT NOT NULL, at REAL NOT NULL, PRIMARY KEY (user_id, event_key))
"""
_PG_SCHEMA = """
CREATE TABLE IF NOT EXISTS heat (
    user_id TEXT COLLATE "C" NOT NULL, memory_id TEXT COLLATE "C" NOT NULL, score DOUBLE PRECISION NOT NULL,
    score_at DOUBLE PRECISION NOT NULL, hits BIGINT NOT NULL, uses BIGINT NOT NULL,
    first_seen DOUBLE PRECISION NOT NULL, last_access DOUBLE PRECISION, last_change DOUBLE PRECISION NOT NULL,
    PRIMARY KEY (user_id, memory_id));
CREATE TABLE IF NOT EXISTS applied (
    user_id TEXT COLLATE "C" NOT NULL, event_key TEXT COLLATE "C" NOT NULL, at DOUBLE PRECISION NOT NULL,
    PRIMARY KEY (user_id, event_key))
"""
# Upserts both databases take (SQLite >= 3.24, PostgreSQL >= 9.5): a row replaced whole, as INSERT OR REPLACE.
_PUT_HEAT = (
    "INSERT INTO heat VALUES (?,?,?,?,?,?,?,?,?) ON CONFLICT (user_id, memory_id) DO UPDATE SET "
    "score = excluded.score, score_at = excluded.score_at, hits = excluded.hits, uses = excluded.uses, "
    "first_seen = excluded.first_seen, last_access = excluded.last_access, last_change = excluded.last_change"
)
_PUT_APPLIED = (
    "INSERT INTO applied VALUES (?,?,?) ON CONFLICT (user_id, event_key) DO UPDATE SET at = excluded.at"
)
_ID_CHUNK = 500  # ids per `IN (...)`
MAX_USERS = 10_000  # users whose heat is held in memory with a writable file (LRU; the rest stay in the file)
REPLAY_WINDOW_S = 24 * 3600.0  # an access event redelivered within this long (event time) is recognised


@dataclass(frozen=True)
class AccessEvent:
    """One served turn: the memories retrieved for it and the ones used, at time `at` (seconds). What counts
    as retrieved and used is `scheduler.accounting.turn_access`'s rule (the search's hits, both)."""

    user_id: str
    retrieved_ids: tuple[str, ...]
    used_ids: tuple[str, ...]
    at: float
    session_id: str | None = None

    @property
    def key(self) -> str:
        """Identity for replay detection (a Redis redelivery, a retried task): same event, same key."""
        parts = [
            self.user_id,
            *self.retrieved_ids,
            "|",
            *self.used_ids,
            "|",
            repr(self.at),
            self.session_id or "",
        ]
        return hashlib.sha256("\x1f".join(parts).encode()).hexdigest()[:32]


@dataclass(frozen=True)
class HeatStats:
    score: float  # decayed heat as of `score_at`
    score_at: float
    hits: int
    uses: int
    first_seen: float
    last_access: float | None
    last_change: float

    def score_now(self, now: float, half_life_s: float) -> float:
        return self.score * math.pow(0.5, max(0.0, now - self.score_at) / half_life_s)

    def stable_for_s(self, now: float) -> float:
        return now - self.last_change


class HeatTable:
    """Thread-safe; writes go through to SQLite when a path is given, to PostgreSQL when it is a
    `postgresql://` URL (the store's database: replicas share it), else memory only."""

    def __init__(
        self,
        path: str | Path | None,
        *,
        half_life_s: float,
        use_weight: float,
        recency_prior: float,
        read_only: bool = False,
        max_users: int = MAX_USERS,
    ):
        """`read_only`: load the table at `path` (if it exists) and keep every change in memory only (the
        offline build reads a live server's heat without writing it)."""
        self.half_life_s, self.use_weight, self.recency_prior = half_life_s, use_weight, recency_prior
        self._lock = threading.RLock()  # re-entered by apply -> record
        # user -> memory -> stats, and user -> event key -> event time. With a writable file only the
        # `max_users` most recently used users are held (loaded from the file on first use, LRU); without one
        # (memory only, or read_only) the table is the only copy and holds everyone
        self._stats: OrderedDict[str, dict[str, HeatStats]] = OrderedDict()
        self._applied: dict[str, dict[str, float]] = {}
        self.max_users = max_users
        self._db = None
        if _is_postgres_url(path):
            self._db = _open_postgres(str(path))
            if read_only:
                try:
                    self._load(self._db)
                finally:
                    self._db.close()
                    self._db = None
        elif path is not None and read_only:
            if Path(path).is_file():
                db = sqlite3.connect(f"file:{Path(path).resolve()}?mode=ro", uri=True)
                try:
                    self._load(db)
                finally:
                    db.close()
        elif path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.executescript(_SCHEMA)

    def _load(self, db: sqlite3.Connection) -> None:
        for row in db.execute("SELECT * FROM heat"):
            self._stats.setdefault(row[0], {})[row[1]] = HeatStats(*row[2:])
        for user_id, key, at in db.execute("SELECT user_id, event_key, at FROM applied"):
            self._applied.setdefault(user_id, {})[key] = at

    def _user(self, user_id: str) -> dict[str, HeatStats]:
        """The user's stats, held (lock held by the caller): loaded from the file on first use; past
        `max_users` held users the least recently used leaves memory (its rows stay in the file)."""
        held = self._stats.get(user_id)
        if held is not None:
            self._stats.move_to_end(user_id)
            return held
        held = self._stats[user_id] = {}
        applied = self._applied[user_id] = {}
        if self._db is not None:
            for row in self._db.execute("SELECT * FROM heat WHERE user_id=?", (user_id,)):
                held[row[1]] = HeatStats(*row[2:])
            for key, at in self._db.execute("SELECT event_key, at FROM applied WHERE user_id=?", (user_id,)):
                applied[key] = at
            while len(self._stats) > self.max_users:
                old, _ = self._stats.popitem(last=False)
                self._applied.pop(old, None)
        return held

    def _put(self, user_id: str, memory_id: str, stats: HeatStats) -> None:
        self._user(user_id)[memory_id] = stats
        if self._db is not None:
            self._db.execute(
                _PUT_HEAT,
                (
                    user_id,
                    memory_id,
                    stats.score,
                    stats.score_at,
                    stats.hits,
                    stats.uses,
                    stats.first_seen,
                    stats.last_access,
                    stats.last_change,
                ),
            )

    def seen(self, user_id: str, memory_id: str, now: float) -> None:
        """A memory was added or changed: it starts (again) from the recency prior; history counts stay."""
        with self._lock:
            old = self._user(user_id).get(memory_id)
            if old is None:
                new = HeatStats(self.recency_prior, now, 0, 0, now, None, now)
            else:
                new = replace(
                    old,
                    score=old.score_now(now, self.half_life_s) + self.recency_prior,
                    score_at=now,
                    last_change=now,
                )
            self._put(user_id, memory_id, new)

    def record(self, user_id: str, retrieved_ids: Iterable[str], used_ids: Iterable[str], now: float) -> None:
        used = set(used_ids)
        with self._lock:
            for memory_id in dict.fromkeys([*retrieved_ids, *used]):
                old = self._user(user_id).get(memory_id) or HeatStats(0.0, now, 0, 0, now, None, now)
                gain = 1.0 + (self.use_weight if memory_id in used else 0.0)
                self._put(
                    user_id,
                    memory_id,
                    replace(
                        old,
                        score=old.score_now(now, self.half_life_s) + gain,
                        score_at=now,
                        hits=old.hits + 1,
                        uses=old.uses + (memory_id in used),
                        last_access=now,
                    ),
                )

    def apply(self, event: AccessEvent, *, live: Container[str] | None = None) -> bool:
        """Record an access event once: a replay of one already applied is ignored (returns False), so an
        access task is idempotent. Keys older than REPLAY_WINDOW_S before the newest event are forgotten.
        `live`: the event's memories that still exist; heat for the others is dropped (None: all count)."""
        key = event.key
        with self._lock:
            self._user(event.user_id)
            seen = self._applied.setdefault(event.user_id, {})
            if key in seen:
                return False
            horizon = event.at - REPLAY_WINDOW_S
            if self._db is not None:  # the key and the heat it adds commit together
                self._db.execute("BEGIN")
            try:
                if self._db is not None:
                    self._db.execute(_PUT_APPLIED, (event.user_id, key, event.at))
                    self._db.execute("DELETE FROM applied WHERE user_id=? AND at<?", (event.user_id, horizon))
                retrieved, used = event.retrieved_ids, event.used_ids
                if live is not None:
                    retrieved = [m for m in retrieved if m in live]
                    used = [m for m in used if m in live]
                self.record(event.user_id, retrieved, used, event.at)
            except BaseException:
                if self._db is not None:
                    self._db.execute("ROLLBACK")
                raise
            if self._db is not None:
                self._db.execute("COMMIT")
            seen[key] = event.at
            for old in [k for k, at in seen.items() if at < horizon]:
                del seen[old]
        return True

    def seen_many(self, user_id: str, first_seen: Iterable[tuple[str, float]]) -> None:
        """`seen` for many memories of one user, written in one transaction (a refresh's first-seen rows, a
        batch of added memories): one commit, not one per row."""
        with self._lock, self._transaction():
            for memory_id, at in first_seen:
                self.seen(user_id, memory_id, at)

    def forget_many(self, user_id: str, memory_ids: Iterable[str]) -> None:
        """Drop the heat of these memories of one user in one statement and one transaction (a whole-user or
        whole-session delete: one commit, not one autocommitted DELETE per memory)."""
        ids = list(dict.fromkeys(memory_ids))
        with self._lock:
            held = self._user(user_id)
            for memory_id in ids:
                held.pop(memory_id, None)
            if self._db is not None and ids:
                with self._transaction():
                    for start in range(0, len(ids), _ID_CHUNK):
                        chunk = ids[start : start + _ID_CHUNK]
                        self._db.execute(
                            f"DELETE FROM heat WHERE user_id=? AND memory_id IN ({','.join('?' * len(chunk))})",
                            (user_id, *chunk),
                        )

    @contextmanager
    def _transaction(self) -> Iterator[None]:
        """One transaction around the writes inside (caller holds the lock); nested: the outer one."""
        if self._db is None or self._db.in_transaction:
            yield
            return
        self._db.execute("BEGIN")
        try:
            yield
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    def forget(self, user_id: str, memory_id: str | None = None) -> None:
        with self._lock:
            if memory_id is None:
                self._stats.pop(user_id, None)
                self._applied.pop(user_id, None)
                if self._db is not None:
                    self._db.execute("DELETE FROM heat WHERE user_id=?", (user_id,))
                    self._db.execute("DELETE FROM applied WHERE user_id=?", (user_id,))
                return
            self._user(user_id).pop(memory_id, None)
            if self._db is not None:
                self._db.execute("DELETE FROM heat WHERE user_id=? AND memory_id=?", (user_id, memory_id))

    def stats(self, user_id: str) -> dict[str, HeatStats]:
        with self._lock:
            if self._db is None:  # the only copy: a read of an unknown user adds nothing
                return dict(self._stats.get(user_id, {}))
            return dict(self._user(user_id))

    def num_tracked(self) -> int:
        with self._lock:
            if self._db is not None:
                return int(self._db.execute("SELECT COUNT(*) FROM heat").fetchone()[0])
            return sum(len(v) for v in self._stats.values())

    def users(self) -> list[str]:
        with self._lock:
            if self._db is not None:
                return [r[0] for r in self._db.execute("SELECT DISTINCT user_id FROM heat ORDER BY user_id")]
            return sorted(self._stats)

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None


def _is_postgres_url(path: object) -> bool:
    return isinstance(path, str) and path.startswith(("postgresql://", "postgres://"))


def _open_postgres(url: str):
    """A connection to the store's PostgreSQL database (kvmem.text.db.pg: sqlite3's statements, reconnects
    after an outage) with the heat tables made if missing; StoreUnavailable if the server cannot be reached."""
    from kvmem.text.db.pg import MIGRATE_LOCK_KEY, PgConnection

    conn = PgConnection(url)
    conn.execute("BEGIN")
    try:
        conn.execute("SELECT pg_advisory_xact_lock(?)", (MIGRATE_LOCK_KEY,))  # replicas starting together
        for statement in _PG_SCHEMA.split(";"):
            if statement.strip():
                conn.execute(statement)
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")
    return conn
