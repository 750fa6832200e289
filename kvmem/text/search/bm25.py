"""Per-user BM25: the keyword leg's scores computed from one user's own statistics.

FTS5's built-in `bm25()` takes its document count, document frequencies and average length from the whole
index, which holds every user's rows, so one user's ranking moved whenever another user wrote. Here the
keyword index only finds matches (porter stemming; scoped to the user) and reports each match's term
frequency (dialect.py: FTS5's `highlight` on SQLite, the term table on PostgreSQL); the document count, each term's document frequency and
the average length come from the user's own active rows, and each row's length from the per-user rows the
search already caches (`UserVectors.lengths`). So a user's keyword ranking depends on that user's memories
only. Same formula as FTS5 (k1 = 1.2, b = 0.75, idf floored at 1e-6). Knows nothing of fusion.
"""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np

from kvmem.text.db.dialect import dialect_of
from kvmem.text.search.term_cache import TermMatches, single_tokens, term_matches
from kvmem.text.search.vectors import UserVectors

K1 = 1.2
B = 0.75
# How a text is split into words for its length: runs of letters and digits, as FTS5's unicode61 tokenizer
# splits (punctuation, spaces and underscores separate).
_LENGTH_RE = re.compile(r"[^\W_]+", re.UNICODE)


def num_tokens(text: str) -> int:
    """A text's length in the words BM25 counts."""
    return len(_LENGTH_RE.findall(text))


def term_frequencies(conn: Any, user_id: str, term: str) -> tuple[list[int], list[int]]:
    """(rowids, term frequencies) of the user's indexed rows holding `term`, stemmed as FTS5 does (the
    dialect's keyword index: FTS5 on SQLite, the term table on PostgreSQL).

    Archived rows are among them; callers keep the rows of their user's active set (`UserVectors`).
    """
    return dialect_of(conn).term_frequencies(conn, user_id, term)


def entry_matches(conn: Any, user_id: str, terms: list[str], entry: UserVectors) -> list[TermMatches]:
    """For each of `terms`, the rows of `entry` holding it (positions, term frequencies): from the entry's term
    cache, or else from the keyword index (then cached: the entry's generation pins the index's rows for this
    user). The missed terms' tokens come from one call of FTS5's tokenizer."""
    assert entry.terms is not None
    found = [entry.terms.get(term) for term in terms]
    missed = [i for i, f in enumerate(found) if f is None]
    for i, token in zip(missed, single_tokens([terms[i] for i in missed]), strict=True):
        rowids, tfs = term_frequencies(conn, user_id, terms[i])
        pos = entry.index_of(np.asarray(rowids, dtype=np.int64))
        keep = pos >= 0  # only the user's active rows (the entry) count
        found[i] = term_matches(pos[keep], np.asarray(tfs, dtype=np.float64)[keep], token)
        entry.terms.put(terms[i], found[i])
    return found  # type: ignore[return-value]  # every None was filled


def score_user(
    conn: Any, user_id: str, terms: list[str], entry: UserVectors
) -> tuple[np.ndarray, np.ndarray]:
    """(positions in `entry`, BM25 scores) of the user's rows matching any term; rows unmatched are left out.

    N, document frequencies and the average length are this user's; positions are ascending.
    """
    n = entry.rowids.shape[0]
    if n == 0 or not terms:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float64)
    lengths = entry.lengths.astype(np.float64)  # [n]
    avgdl = max(float(lengths.mean()), 1e-9)
    norm = K1 * (1 - B + B * lengths / avgdl)  # [n]
    scores = np.zeros(n, dtype=np.float64)  # [n]
    matched = np.zeros(n, dtype=bool)  # [n]
    for pos, tf, _ in entry_matches(conn, user_id, terms, entry):
        if pos.shape[0] == 0:
            continue
        hits = pos.shape[0]
        idf = math.log((n - hits + 0.5) / (hits + 0.5))
        idf = idf if idf > 0 else 1e-6
        scores[pos] += idf * tf * (K1 + 1) / (tf + norm[pos])
        matched[pos] = True
    idx = np.flatnonzero(matched)
    return idx, scores[idx]


def rank(
    idx: np.ndarray, scores: np.ndarray, entry: UserVectors, allowed: np.ndarray | None, limit: int
) -> list[tuple[int, float]]:
    """The best `limit` of the scored rows that pass `allowed`, as (rowid, score); ties: lower rowid first."""
    rowids = entry.rowids[idx]
    if allowed is not None:
        keep = np.isin(rowids, allowed)
        rowids, scores = rowids[keep], scores[keep]
    order = np.lexsort((rowids, -scores))[:limit]
    return [(int(rowids[i]), float(scores[i])) for i in order]
