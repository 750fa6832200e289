"""A text's keyword terms exactly as the SQLite store's FTS5 index stems them, for stores without FTS5.

Owns one in-memory SQLite per thread holding an FTS5 table with the store's tokenizer (porter, unicode61,
diacritics removed) and its `fts5vocab` view: a text goes in, its (term, count) pairs come out. So the
PostgreSQL store's term table holds the very stems FTS5 would, and per-user BM25 scores agree with the
SQLite store's. Knows nothing of users or tables.
"""

from __future__ import annotations

import sqlite3
import threading
from collections import Counter

TOKENIZE = "porter unicode61 remove_diacritics 2"  # the store's FTS5 tokenizer (schema.py's memories_fts)

_local = threading.local()


def _conn() -> sqlite3.Connection:
    conn = getattr(_local, "conn", None)
    if conn is None:
        conn = sqlite3.connect(":memory:", isolation_level=None)
        conn.execute(f"CREATE VIRTUAL TABLE doc USING fts5 (text, tokenize = '{TOKENIZE}')")
        conn.execute("CREATE VIRTUAL TABLE vocab USING fts5vocab (doc, 'instance')")
        _local.conn = conn
    return conn


def term_counts(texts: list[str]) -> list[Counter[str]]:
    """For each text, how often each stemmed term occurs in it (FTS5's tokens: `tf` of BM25)."""
    if not texts:
        return []
    conn = _conn()
    conn.execute("BEGIN")
    try:
        conn.executemany("INSERT INTO doc (rowid, text) VALUES (?, ?)", list(enumerate(texts)))
        counts: list[Counter[str]] = [Counter() for _ in texts]
        for doc, term, n in conn.execute("SELECT doc, term, count(*) FROM vocab GROUP BY doc, term"):
            counts[doc][term] = n
    finally:
        conn.execute("ROLLBACK")
    return counts


def query_tokens(term: str) -> list[str]:
    """The stemmed tokens one query word becomes (usually one; 'a_b' is two: FTS5 reads it as a phrase)."""
    return [t for t, _ in sorted(term_counts([term])[0].items())] if term.strip() else []
