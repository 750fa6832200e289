"""SQLite schema of the plaintext store and its versioned migrations.

Owns the table layout and `PRAGMA user_version` (PostgreSQL's counterpart: pg_schema.py); each migration runs in its own transaction, so a file is
always at one known version. Knows nothing of the store's operations.
"""

from __future__ import annotations

import logging
import sqlite3

from kvmem.text.db.dialect import dialect_of
from kvmem.text.errors import TextStoreError

logger = logging.getLogger(__name__)

_V1 = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE memories (
    rowid INTEGER PRIMARY KEY,
    id TEXT NOT NULL UNIQUE,
    user_id TEXT NOT NULL,
    session_id TEXT,
    agent_id TEXT,
    role TEXT,
    text TEXT NOT NULL,
    created_at TEXT NOT NULL,
    chat_time TEXT NOT NULL,
    updated_at TEXT NOT NULL,
    tags TEXT NOT NULL DEFAULT '[]',
    metadata TEXT NOT NULL DEFAULT '{}',
    state TEXT NOT NULL CHECK (state IN ('active', 'archived', 'deleted')),
    version INTEGER NOT NULL
);
CREATE INDEX memories_by_user ON memories (user_id, state, created_at);
CREATE INDEX memories_by_session ON memories (user_id, session_id);
CREATE INDEX memories_by_chat_time ON memories (user_id, chat_time);
CREATE TABLE memory_versions (
    memory_rowid INTEGER NOT NULL REFERENCES memories (rowid) ON DELETE CASCADE,
    version INTEGER NOT NULL,
    text TEXT NOT NULL,
    tags TEXT NOT NULL,
    metadata TEXT NOT NULL,
    updated_at TEXT NOT NULL,
    PRIMARY KEY (memory_rowid, version)
);
CREATE TABLE memory_vectors (
    rowid INTEGER PRIMARY KEY REFERENCES memories (rowid) ON DELETE CASCADE,
    user_id TEXT NOT NULL,
    vec BLOB NOT NULL
);
CREATE INDEX memory_vectors_by_user ON memory_vectors (user_id);
CREATE TABLE user_generation (user_id TEXT PRIMARY KEY, gen INTEGER NOT NULL);
CREATE VIRTUAL TABLE memories_fts USING fts5 (text, owner, tokenize = 'porter unicode61 remove_diacritics 2');
INSERT INTO memories_fts (memories_fts, rank) VALUES ('rank', 'bm25(1.0, 0.0)');
"""

# V2: supersession and provenance columns on memories (existing rows: valid_from = chat_time, source 'api'),
# and the conversation log, kept apart from memories (`turns`; formation: kvmem/formation).
_V2 = """
ALTER TABLE memories ADD COLUMN valid_from TEXT;
ALTER TABLE memories ADD COLUMN valid_to TEXT;
ALTER TABLE memories ADD COLUMN superseded_by TEXT;
ALTER TABLE memories ADD COLUMN source TEXT NOT NULL DEFAULT 'api';
ALTER TABLE memories ADD COLUMN source_turn_ids TEXT NOT NULL DEFAULT '[]';
ALTER TABLE memories ADD COLUMN slot TEXT;
ALTER TABLE memories ADD COLUMN slot_value TEXT;
UPDATE memories SET valid_from = chat_time;
CREATE INDEX memories_by_slot ON memories (user_id, slot);
CREATE TABLE turns (
    rowid INTEGER PRIMARY KEY,
    id TEXT NOT NULL UNIQUE,
    user_id TEXT NOT NULL,
    session_id TEXT,
    role TEXT NOT NULL,
    speaker TEXT,
    text TEXT NOT NULL,
    chat_time TEXT NOT NULL,
    created_at TEXT NOT NULL,
    formation TEXT NOT NULL CHECK (formation IN ('pending', 'formed', 'skipped', 'dead')),
    attempts INTEGER NOT NULL DEFAULT 0,
    error TEXT,
    updated_at TEXT NOT NULL
);
CREATE INDEX turns_by_formation ON turns (user_id, formation);
CREATE INDEX turns_by_session ON turns (user_id, session_id);
"""

# V3: the generation at which a user was last wholly deleted (delete_user; 0: never). A turn of a request
# admitted at an earlier generation is not logged after the delete (log_turns' admitted_generation).
_V3 = """
ALTER TABLE user_generation ADD COLUMN erased_gen INTEGER NOT NULL DEFAULT 0;
"""

# V4: write receipts (receipts.py): the answer a keyed write (Idempotency-Key) gave, recorded in the write's
# own transaction, so a repeat through any process sharing the store finds it.
_V4 = """
CREATE TABLE write_receipts (
    user_id TEXT NOT NULL,
    scope TEXT NOT NULL,
    key TEXT NOT NULL,
    fingerprint TEXT NOT NULL,
    status INTEGER NOT NULL,
    body TEXT NOT NULL,
    stored_at REAL NOT NULL,
    PRIMARY KEY (user_id, scope, key)
);
CREATE INDEX write_receipts_by_age ON write_receipts (stored_at);
"""

# V5: what a delete must reach in the log (issue 42 items 10, 27): the turn a reply answers (`reply_to`), the
# memories a reply was generated with (`turn_uses`, gone with its turn), and the generation at which a
# session was deleted (`erased_sessions`: a turn of a request admitted before is not logged into it after).
_V5 = """
ALTER TABLE turns ADD COLUMN reply_to TEXT;
CREATE INDEX turns_by_reply ON turns (user_id, reply_to);
CREATE TABLE turn_uses (
    turn_id TEXT NOT NULL REFERENCES turns (id) ON DELETE CASCADE,
    user_id TEXT NOT NULL,
    memory_id TEXT NOT NULL,
    PRIMARY KEY (turn_id, memory_id)
);
CREATE INDEX turn_uses_by_memory ON turn_uses (user_id, memory_id);
CREATE TABLE erased_sessions (
    user_id TEXT NOT NULL,
    session_id TEXT NOT NULL,
    erased_gen INTEGER NOT NULL,
    PRIMARY KEY (user_id, session_id)
);
"""

# Migration i (1-based) brings a file from user_version i-1 to i. Append, never edit.
MIGRATIONS: tuple[str, ...] = (_V1, _V2, _V3, _V4, _V5)
SCHEMA_VERSION = len(MIGRATIONS)


def migrate(conn: sqlite3.Connection) -> int:
    """Applies pending migrations, each in one transaction; returns the file's schema version. A
    PostgreSQL connection (pg.py) is migrated by pg_schema.py's migrations instead."""
    if dialect_of(conn).name == "postgresql":
        from kvmem.text.db import pg_schema  # psycopg is imported only where PostgreSQL is used

        return pg_schema.migrate(conn)
    current = conn.execute("PRAGMA user_version").fetchone()[0]
    if current > SCHEMA_VERSION:
        raise TextStoreError(
            f"store file has schema version {current}, newer than this code's {SCHEMA_VERSION}; upgrade kvmem"
        )
    for version in range(current + 1, SCHEMA_VERSION + 1):
        conn.execute("BEGIN IMMEDIATE")
        try:
            if (
                conn.execute("PRAGMA user_version").fetchone()[0] >= version
            ):  # another process got there first
                conn.execute("ROLLBACK")
                continue
            for statement in MIGRATIONS[version - 1].split(";"):
                if statement.strip():
                    conn.execute(statement)
            conn.execute(f"PRAGMA user_version = {version}")
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        logger.info("plaintext store migrated to schema version %d", version)
    return SCHEMA_VERSION
