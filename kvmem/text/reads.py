"""The store's reads, mixed into MemoryStore: one memory, its history, memories by id, pages, counts, search.

Owns each read's checks and its one snapshot (db.py) of row statements (rows.py); ranking is search.py's.
Every query carries the user id, so no read returns another user's memory. Writes nothing, and knows nothing
of how rows are written, of dumps, HTTP, KV items or scheduling.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterable
from datetime import datetime

import numpy as np

from kvmem.text.config import TextStoreConfig
from kvmem.text.db.connections import Database
from kvmem.text.db.rows import (
    COLUMNS,
    CURRENT,
    LIVE,
    active_by_rowids,
    find_live,
    live_by_ids,
    read_versions,
    row_to_memory,
)
from kvmem.text.errors import InvalidMemoryInput, MemoryNotFound
from kvmem.text.filters import (
    SearchFilters,
    check_int,
    check_memory_id,
    check_min_score,
    check_optional_id,
    check_text,
    check_user_id,
    filter_sql,
    merge_session_id,
    parse_filters,
)
from kvmem.text.records import Memory, MemoryVersion, Page, SearchHit
from kvmem.text.search.embedders import Embedder
from kvmem.text.search.hybrid import SEARCH_MODES, rank_rows
from kvmem.text.search.rerank import Reranker
from kvmem.text.search.rerank_stage import Candidates
from kvmem.text.search.vectors import VectorCache

_LIST_STATES = {"active": "m.state = 'active'", "archived": "m.state = 'archived'", "all": LIVE}


class MemoryReads:
    """The reads on MemoryStore; the store provides what is declared here."""

    _db: Database
    _clock: Callable[[], datetime]
    _vectors: VectorCache
    config: TextStoreConfig
    embedder: Embedder
    _conn: Callable[[], sqlite3.Connection]
    _embed: Callable[[list[str]], np.ndarray]
    _embed_query: Callable[[str], np.ndarray]
    _reranker: Callable[[], Reranker | None]

    # ----------------------------------------------------------------- read one

    def get(self, user_id: str, memory_id: str) -> Memory:
        """The live memory `memory_id` of `user_id`, superseded or not (its valid_to and superseded_by say);
        MemoryNotFound if absent, deleted or another user's."""
        check_user_id(user_id)
        check_memory_id(memory_id)
        found = find_live(self._conn(), user_id, memory_id)
        if found is None:
            raise MemoryNotFound(memory_id, user_id)
        return found.memory

    def history(self, user_id: str, memory_id: str) -> list[MemoryVersion]:
        """Previous versions of a memory, oldest first (the current one is `get`)."""
        check_user_id(user_id)
        check_memory_id(memory_id)
        with self._db.snapshot() as conn:
            found = find_live(conn, user_id, memory_id)
            if found is None:
                raise MemoryNotFound(memory_id, user_id)
            return read_versions(conn, found.rowid)

    def memories_by_ids(
        self, user_id: str, ids: Iterable[str], include_superseded: bool = False
    ) -> list[Memory]:
        """This user's live memories with these ids, in the given order; missing ids are skipped, and so are
        superseded memories unless `include_superseded` (the KV tiers build only from what is served)."""
        check_user_id(user_id)
        ids = list(ids)
        for memory_id in ids:
            check_memory_id(memory_id)
        with self._db.snapshot() as conn:
            found = live_by_ids(conn, user_id, list(dict.fromkeys(ids)), include_superseded)
        return [found[i] for i in ids if i in found]

    # ----------------------------------------------------------------- list and count

    def list(
        self,
        user_id: str,
        *,
        session_id: str | None = None,
        page: int = 1,
        page_size: int = 20,
        filters: dict | SearchFilters | None = None,
        state: str = "active",
        include_superseded: bool = False,
    ) -> Page:
        """This user's memories, newest first (created_at, then insertion order); state: active|archived|all.
        Superseded memories are left out unless `include_superseded`."""
        check_user_id(user_id)
        check_optional_id(session_id, "session_id")
        check_int(page, "page", 1, 2**31)
        check_int(page_size, "page_size", 1, self.config.max_page_size)
        if state not in _LIST_STATES:
            raise InvalidMemoryInput(f"state must be one of {sorted(_LIST_STATES)}, got {state!r}")
        clause, params = filter_sql(merge_session_id(parse_filters(filters), session_id), self._db.dialect)
        current = "" if include_superseded else f" AND {CURRENT}"
        where = f"m.user_id = ? AND {_LIST_STATES[state]}{current}{clause}"
        with self._db.snapshot() as conn:
            total = conn.execute(
                f"SELECT count(*) FROM memories m WHERE {where}", (user_id, *params)
            ).fetchone()[0]
            rows = conn.execute(
                f"SELECT {COLUMNS} FROM memories m WHERE {where} ORDER BY m.created_at DESC, m.rowid DESC "
                "LIMIT ? OFFSET ?",
                (user_id, *params, page_size, (page - 1) * page_size),
            ).fetchall()
        return Page(items=[row_to_memory(r) for r in rows], page=page, page_size=page_size, total=total)

    def count(self, user_id: str) -> int:
        """How many live (active or archived) memories this user has, superseded ones included."""
        check_user_id(user_id)
        return (
            self._conn()
            .execute(f"SELECT count(*) FROM memories m WHERE m.user_id = ? AND {LIVE}", (user_id,))
            .fetchone()[0]
        )

    def count_by_user(self) -> dict[str, int]:
        """Live memories per user, for every user in the file (an operator view: it names all users)."""
        rows = (
            self._conn()
            .execute(
                f"SELECT m.user_id, count(*) FROM memories m WHERE {LIVE} "
                "GROUP BY m.user_id ORDER BY m.user_id"
            )
            .fetchall()
        )
        return dict(rows)

    # ----------------------------------------------------------------- search

    def search_candidates(self, user_id: str, query: str) -> Candidates | None:
        """The second stage's input for a hybrid search of `query` (the first stage's top rerank_depth with
        their features and texts), or None when the user has no candidates. For fitting and measuring
        rerankers (benchmarks/memory/rerank_train.py); search itself never needs it."""
        check_user_id(user_id)
        check_text(query, self.config.max_text_tokens, self.config.max_text_chars, "query")
        kept: list[Candidates] = []
        with self._db.snapshot() as conn:
            rank_rows(
                conn,
                self._vectors,
                self.embedder.dim,
                user_id,
                query,
                self._embed_query(query),
                parse_filters(None),
                "hybrid",
                10,
                self.config,
                self._clock,
                keep_candidates=kept,
            )
        return kept[0] if kept else None

    def search(
        self,
        user_id: str,
        query: str,
        *,
        top_k: int = 10,
        filters: dict | SearchFilters | None = None,
        min_score: float | None = None,
        mode: str = "hybrid",
        include_superseded: bool = False,
    ) -> list[SearchHit]:
        """This user's served memories best matching `query`, best first; with `include_superseded`, every
        active one, superseded ones too (for questions about the past; not cached, so slower).

        mode: keyword (FTS5 BM25), dense (cosine over embeddings) or hybrid (the two fused, with
        conversational context: see search.fuse_legs; score in [0, 1]). min_score applies to that mode's
        score.
        """
        check_user_id(user_id)
        check_text(query, self.config.max_text_tokens, self.config.max_text_chars, "query")
        check_int(top_k, "top_k", 1, self.config.max_top_k)
        if mode not in SEARCH_MODES:
            raise InvalidMemoryInput(f"mode must be one of {list(SEARCH_MODES)}, got {mode!r}")
        check_min_score(min_score)
        query_vector = self._embed_query(query) if mode != "keyword" else None
        with self._db.snapshot() as conn:
            ranked = rank_rows(
                conn,
                self._vectors,
                self.embedder.dim,
                user_id,
                query,
                query_vector,
                parse_filters(filters),
                mode,
                top_k,
                self.config,
                self._clock,
                include_superseded,
                self._reranker() if mode == "hybrid" else None,
            )
        if min_score is not None:
            ranked = [(r, s) for r, s in ranked if s >= min_score]
        ranked = ranked[:top_k]
        if not ranked:
            return []
        by_rowid = active_by_rowids(self._conn(), user_id, [r for r, _ in ranked], include_superseded)
        return [SearchHit(memory=by_rowid[r], score=s) for r, s in ranked if r in by_rowid]
