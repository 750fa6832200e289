"""Where the first stage hands over to the second: its top candidates, their texts and features, the reranker's
scores and the final order.

Owns reading the candidates' texts (one query, inside the caller's snapshot), building the `Candidates` a
reranker sees, and what happens when the reranker cannot answer (the first stage's order, with a log line).
Knows nothing of how the first stage ranked, nor of how a reranker scores.
"""

from __future__ import annotations

import logging
import sqlite3
from dataclasses import dataclass

import numpy as np

from kvmem.text.errors import RerankerUnavailable
from kvmem.text.search.rerank import Reranker, apply_scores
from kvmem.text.search.rerank_features import LegScores, candidate_features
from kvmem.text.search.vectors import UserVectors

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Candidates:
    """The first stage's top candidates of one hybrid search, as the second stage sees them."""

    ranked: list[tuple[int, float]]  # (rowid, first-stage score), best first
    memory_ids: list[str]  # [n]
    texts: list[str]  # [n]
    features: np.ndarray  # [n, NUM_FEATURES] float64


def texts_by_rowid(conn: sqlite3.Connection, rowids: list[int]) -> dict[int, tuple[str, str]]:
    """rowid -> (memory id, text) of these memory rows (the caller's user's, chosen by the first stage)."""
    marks = ",".join("?" * len(rowids))
    rows = conn.execute(f"SELECT rowid, id, text FROM memories WHERE rowid IN ({marks})", rowids).fetchall()
    return {r[0]: (r[1], r[2]) for r in rows}


def second_stage(
    conn: sqlite3.Connection,
    ranked: list[tuple[int, float]],
    legs: LegScores,
    entry: UserVectors,
    query_vector: np.ndarray,
    query: str,
    depth: int,
    reranker: Reranker | None,
    keep_candidates: list[Candidates] | None = None,
) -> list[tuple[int, float]]:
    """`ranked` (the first stage's order, best first) with its top `depth` reordered by `reranker`.

    `keep_candidates`, if given, receives the reranker's input. A RerankerUnavailable keeps `ranked` as it
    is, with a log line: the search never fails for it."""
    head = ranked[: min(depth, len(ranked))]
    rows = texts_by_rowid(conn, [r for r, _ in head])
    ids, texts = [rows[r][0] for r, _ in head], [rows[r][1] for r, _ in head]
    candidates = Candidates(
        head, ids, texts, candidate_features(head, legs, entry, query_vector, query, texts)
    )
    if keep_candidates is not None:
        keep_candidates.append(candidates)
    if reranker is None:
        return ranked
    try:
        scores = reranker.score(query, candidates.texts, candidates.features)
    except RerankerUnavailable as exc:
        logger.warning("reranker %s unavailable (%s); search keeps the first-stage order", reranker.name, exc)
        return ranked
    return apply_scores(ranked, np.asarray(scores, dtype=np.float64))
