"""The store's side of embeddings: shape-checked vectors for texts, and which embedder made a file's vectors.

Owns the one-text LRUs (a chat turn is often searched, then stored; query vectors apart from memory vectors),
the `meta` rows 'embedder' and 'dim',
and re-embedding a file opened with another embedder. The models themselves are embedders.py's; knows
nothing of search, locks or events.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import numpy as np

from kvmem.text.conversation import turns
from kvmem.text.conversation.context import FORMED_SOURCE, in_context
from kvmem.text.db.rows import LIVE
from kvmem.text.errors import EmbedderMismatch, TextStoreError
from kvmem.text.search.embedders import Embedder

logger = logging.getLogger(__name__)

_QUERY_CACHE_SIZE = 256


class TextVectorCache:
    """LRU of single texts' vectors, bounded in entries. Thread-safe."""

    def __init__(self, max_entries: int = _QUERY_CACHE_SIZE) -> None:
        self._max_entries = max_entries
        self._entries: OrderedDict[str, np.ndarray] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, text: str) -> np.ndarray | None:
        with self._lock:
            vector = self._entries.get(text)
            if vector is not None:
                self._entries.move_to_end(text)
            return vector

    def put(self, text: str, vector: np.ndarray) -> None:
        with self._lock:
            self._entries[text] = vector
            if len(self._entries) > self._max_entries:
                self._entries.popitem(last=False)


def embed_texts(embedder: Embedder, texts: list[str], cache: TextVectorCache) -> np.ndarray:
    """Vectors for texts, [n, dim] float32; TextStoreError if the embedder returns another shape.

    Single texts go through `cache` (a turn is often searched, then stored); batches do not.
    """
    if len(texts) == 1:
        cached = cache.get(texts[0])
        if cached is not None:
            return cached[None, :]
    vectors = np.asarray(embedder.embed(list(texts)), dtype=np.float32)  # [n, dim]
    if vectors.shape != (len(texts), embedder.dim):
        raise TextStoreError(
            f"embedder {embedder.name!r} returned shape {vectors.shape}, expected ({len(texts)}, {embedder.dim})"
        )
    if len(texts) == 1:
        cache.put(texts[0], vectors[0])
    return vectors


def embed_query(
    embedder: Embedder, text: str, cache: TextVectorCache, query_cache: TextVectorCache
) -> np.ndarray:
    """The vector a search for `text` ranks by, [dim] float32.

    An embedder with `embed_for_search` (the default: its query head pools the query's tokens) gives the
    text's memory vector and its query vector from one forward: the memory vector goes into `cache` (the
    searched turn is often stored next), the query vector into `query_cache` only, so a query vector never
    becomes a stored memory's. Other embedders: the text's memory vector (`embed_texts`)."""
    search = getattr(embedder, "embed_for_search", None)
    if search is None:
        return embed_texts(embedder, [text], cache)[0]
    cached = query_cache.get(text)
    if cached is not None:
        return cached
    memory, query = (np.asarray(v, dtype=np.float32) for v in search([text]))
    for vectors in (memory, query):
        if vectors.shape != (1, embedder.dim):
            raise TextStoreError(
                f"embedder {embedder.name!r} returned shape {vectors.shape}, expected (1, {embedder.dim})"
            )
    cache.put(text, memory[0])
    query_cache.put(text, query[0])
    return query[0]


def reconcile_embedder(
    conn: sqlite3.Connection,
    path: Path | str,
    name: str,
    dim: int,
    embed: Callable[[list[str]], np.ndarray],
    reembed_on_mismatch: bool,
) -> None:
    """Records embedder `name` (dim `dim`) in a new file, or checks it against the file's record.

    Vectors of two embedders never mix: on a mismatch with vectors present this raises EmbedderMismatch,
    unless `reembed_on_mismatch`, where every live memory is embedded again with `embed` and every user's
    generation bumped (so no cached matrix of the old space survives). Runs in the caller's write
    transaction.
    """
    rows = dict(conn.execute("SELECT key, value FROM meta WHERE key IN ('embedder', 'dim')"))
    if not rows:
        conn.executemany(
            "INSERT INTO meta (key, value) VALUES (?, ?)", [("embedder", name), ("dim", str(dim))]
        )
        return
    if rows.get("embedder") == name and rows.get("dim") == str(dim):
        return
    has_vectors = conn.execute("SELECT 1 FROM memory_vectors LIMIT 1").fetchone() is not None
    if has_vectors and not reembed_on_mismatch:
        raise EmbedderMismatch(
            f"{path} holds vectors of embedder {rows.get('embedder')!r} (dim {rows.get('dim')}), "
            f"opened with {name!r} (dim {dim}); open it with that embedder or pass "
            "TextStoreConfig(reembed_on_mismatch=True) to re-embed every memory"
        )
    conn.executemany("UPDATE meta SET value = ? WHERE key = ?", [(name, "embedder"), (str(dim), "dim")])
    if has_vectors:
        logger.warning("re-embedding %s with %s", path, name)
        rows_to_embed = conn.execute(
            "SELECT m.rowid, m.user_id, m.text, m.source, m.source_turn_ids FROM memories m WHERE " + LIVE
        ).fetchall()
        # a formed memory is embedded in the context of its turns still in the log, as commit_formed does
        contexts: list[list[str]] = [[] for _ in rows_to_embed]
        by_user: dict[str, list[int]] = {}
        for i, r in enumerate(rows_to_embed):
            if r[3] == FORMED_SOURCE:
                by_user.setdefault(r[1], []).append(i)
        for user, rows in by_user.items():
            cited = turns.cited_texts(conn, user, [json.loads(rows_to_embed[i][4]) for i in rows])
            for i, texts in zip(rows, cited, strict=True):
                contexts[i] = texts
        vectors = in_context(embed, [r[2] for r in rows_to_embed], contexts)
        conn.execute("DELETE FROM memory_vectors")
        conn.executemany(
            "INSERT INTO memory_vectors (rowid, user_id, vec) VALUES (?, ?, ?)",
            [(r[0], r[1], v.tobytes()) for r, v in zip(rows_to_embed, vectors, strict=False)],
        )
        conn.execute("UPDATE user_generation SET gen = gen + 1")
