"""Hybrid search: the keyword leg (BM25 over the user's own rows, bm25.py), the dense leg (exact scan of
cached vectors) and their fusion.

Owns how a chat message becomes keyword terms, how each leg ranks one user's active memories inside the
caller's read snapshot, and how two rankings become one (then hands the fused top to the second stage,
rerank_stage.py): both legs lean on neighbouring turns of the same
session (an answer often lacks the topic words of the turn before it), rank fusion that weighs keyword above
dense (measured on real dialogue, benchmarks/memory/recall_bench.py), and lifts for turns spoken by someone the
query names and for turns of a time it names (when.py). Knows nothing of transactions, embedders, or how
ranked rows become Memory objects.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, NamedTuple

import numpy as np

from kvmem.text.config import TextStoreConfig
from kvmem.text.db.dialect import dialect_of, owner_token
from kvmem.text.filters import SearchFilters, filter_sql
from kvmem.text.search import bm25
from kvmem.text.search.rerank import Reranker
from kvmem.text.search.rerank_features import LegScores, speaker_of
from kvmem.text.search.rerank_stage import Candidates, second_stage
from kvmem.text.search.vectors import UserVectors, VectorCache, dot_rows, top_k_by_dot
from kvmem.text.search.when import parse_query_time

SEARCH_MODES = ("hybrid", "keyword", "dense")

# Function words that carry no retrieval signal in chat questions; dropped from keyword queries (BM25 would
# weigh them low anyway, but each one widens the candidate set FTS5 must score).
STOPWORDS = frozenset(
    """a about above after again against all am an and any are as at be because been before being below
    between both but by can could did do does doing down during each few for from further had has have having
    he her here hers herself him himself his how i if in into is it its itself just me more most my myself no
    nor not now of off on once only or other our ours ourselves out over own same she should so some such than
    that the their theirs them themselves then there these they this those through to too under until up very
    was we were what when where which while who whom why will with would you your yours yourself yourselves
    s t don didn doesn isn wasn aren weren ve ll re d m o y tell remember know said say mentioned""".split()
)
_WORD_RE = re.compile(r"\w+", re.UNICODE)


def keyword_terms(query: str) -> list[str]:
    """Lower-cased distinct words of the query, stopwords dropped (all words kept if nothing else is left)."""
    words = [w.lower() for w in _WORD_RE.findall(query)]
    terms = [w for w in dict.fromkeys(words) if w not in STOPWORDS]
    return terms or list(dict.fromkeys(words))


def fts_match_expression(user_id: str, query: str) -> str | None:
    """`owner : "<token>" AND text : ("a" OR "b" ...)`, or None when the query has no words."""
    terms = keyword_terms(query)
    if not terms:
        return None
    ored = " OR ".join('"' + t.replace('"', '""') + '"' for t in terms)
    return f'owner : "{owner_token(user_id)}" AND text : ({ored})'


class FusedHit(NamedTuple):
    """A row after fusion, with its fused score and its 1-based rank in each leg (None: not retrieved).
    A NamedTuple, not a dataclass: a hybrid search makes a few hundred, and a frozen dataclass's __init__
    costs several times a tuple's."""

    rowid: int
    score: float
    keyword_rank: int | None
    dense_rank: int | None


def reciprocal_rank_fusion(
    keyword: list[int],
    dense: list[int],
    k: int,
    keyword_weight: float,
    dense_weight: float,
    window: list[int] | None = None,
    window_weight: float = 0.0,
) -> list[FusedHit]:
    """RRF: score = sum over legs of weight / (k + rank), scaled so a row first in every leg scores 1.0.

    `window` is the optional third leg (windowed dense, `window_leg`), weighed `window_weight`. Ties are
    broken by the better keyword / dense rank, then by rowid, so the order is deterministic.
    """
    keyword_rank = {rowid: rank for rank, rowid in enumerate(keyword, start=1)}
    dense_rank = {rowid: rank for rank, rowid in enumerate(dense, start=1)}
    window = window if window and window_weight > 0 else []
    window_rank = {rowid: rank for rank, rowid in enumerate(window, start=1)}
    best = keyword_weight / (k + 1) + dense_weight / (k + 1) + (window_weight / (k + 1) if window else 0.0)
    hits = []
    for rowid in dict.fromkeys([*keyword, *dense, *window]):
        kr, dr, wr = keyword_rank.get(rowid), dense_rank.get(rowid), window_rank.get(rowid)
        score = (keyword_weight / (k + kr) if kr else 0.0) + (dense_weight / (k + dr) if dr else 0.0)
        score += window_weight / (k + wr) if wr else 0.0
        hits.append(FusedHit(rowid=rowid, score=score / best, keyword_rank=kr, dense_rank=dr))
    hits.sort(key=lambda h: (-h.score, min(h.keyword_rank or 1 << 30, h.dense_rank or 1 << 30), h.rowid))
    return hits


def keyword_leg(
    conn: Any,
    entry: UserVectors | None,
    user_id: str,
    query: str,
    allowed: np.ndarray | None,
    limit: int,
) -> list[tuple[int, float]]:
    """(rowid, BM25 score) of this user's active memories sharing a word with the query, best first.

    BM25 with the user's own statistics (bm25.py), so another user's writes never change this ranking;
    `allowed` (the filters) narrows the results, not the statistics.
    """
    terms = keyword_terms(query)
    if entry is None or not terms:
        return []
    idx, scores = bm25.score_user(conn, user_id, terms, entry)
    return bm25.rank(idx, scores, entry, allowed, limit)


def user_rows(
    conn: Any, vectors: VectorCache, dim: int, user_id: str, include_superseded: bool = False
) -> UserVectors | None:
    """This user's served rows (vectors, sessions, speakers) at the file's generation; None: no rows ever.

    Comes from `vectors` while its generation is the file's; otherwise it is read in this snapshot and cached.
    With `include_superseded`, every active row, superseded ones too: read in this snapshot and never cached
    (the cache holds what is served; a supersession bumps the generation, so a cached matrix never holds a
    superseded row).
    """
    row = conn.execute("SELECT gen FROM user_generation WHERE user_id = ?", (user_id,)).fetchone()
    if row is None:
        return None
    entry = None if include_superseded else vectors.get(user_id, row[0])
    if entry is None:
        served = "m.state = 'active'" + ("" if include_superseded else " AND m.valid_to IS NULL")
        rows = conn.execute(
            "SELECT v.rowid, v.vec, m.session_id, m.role, m.text, m.metadata FROM memory_vectors v JOIN memories m "
            f"ON m.rowid = v.rowid WHERE v.user_id = ? AND {served} ORDER BY v.rowid",
            (user_id,),
        ).fetchall()
        matrix = np.frombuffer(b"".join(r[1] for r in rows), dtype=np.float32).reshape(len(rows), dim)
        entry = UserVectors(
            gen=row[0],
            rowids=np.fromiter((r[0] for r in rows), dtype=np.int64, count=len(rows)),
            matrix=matrix,  # [n, dim]
            sessions=np.array([r[2] for r in rows], dtype=object),
            speakers=np.array([speaker_of(r[3], _speaker_metadata(r[5])) for r in rows], dtype=object),
            lengths=np.fromiter((bm25.num_tokens(r[4]) for r in rows), dtype=np.int64, count=len(rows)),
        )
        if not include_superseded:
            vectors.put(user_id, entry)
    return entry


def _speaker_metadata(metadata_json: str | None) -> dict | None:
    """The metadata of a row, parsed only when it may hold a speaker (most rows' metadata is '{}')."""
    if not metadata_json or '"speaker"' not in metadata_json:
        return None
    return json.loads(metadata_json)


def rowids_in_time(conn: Any, user_id: str, start: str, end: str) -> np.ndarray:
    """The rowids of this user's active memories whose chat_time is in [start, end]."""
    rows = conn.execute(
        "SELECT m.rowid FROM memories m WHERE m.user_id = ? AND m.chat_time >= ? AND m.chat_time <= ? "
        "AND m.state = 'active'",
        (user_id, start, end),
    )
    return np.fromiter((r[0] for r in rows), dtype=np.int64)


def allowed_rowids(conn: Any, user_id: str, filters: SearchFilters) -> np.ndarray | None:
    """The rowids of this user's active memories that pass `filters`; None when there are no filters."""
    if filters.is_empty:
        return None
    clause, params = filter_sql(filters, dialect_of(conn))
    return np.fromiter(
        (
            r[0]
            for r in conn.execute(
                f"SELECT m.rowid FROM memories m WHERE m.user_id = ? AND m.state = 'active'{clause}",
                (user_id, *params),
            )
        ),
        dtype=np.int64,
    )


def dense_leg(
    entry: UserVectors | None,
    query_vector: np.ndarray,
    allowed: np.ndarray | None,
    limit: int,
    neighbour_weight: float = 0.0,
) -> list[tuple[int, float]]:
    """(rowid, cosine) of the user's active memories nearest the query vector, best first (with
    `neighbour_weight`, hybrid's dense candidates: cosine plus that share of their neighbours', vectors.py).

    Filters arrive as a set of allowed rowids, so the cache holds one matrix per user whatever the filters.
    """
    if entry is None:
        return []
    return top_k_by_dot(entry, query_vector, limit, allowed, neighbour_weight)


def spread_to_neighbours(
    keyword: list[tuple[int, float]],
    entry: UserVectors,
    weight: float,
    allowed: np.ndarray | None,
    limit: int | None = None,
) -> list[tuple[int, float]]:
    """Keyword hits re-scored with their conversation: score + weight * max(score of the previous turn,
    score of the next turn of the same session), over the hits and their neighbours, best first (with
    `limit`, the best `limit` only: the same first `limit` items).

    Why: in real dialogue the answer is often a reply ("Yes, every morning!") whose topic words are in the
    neighbouring turn, so BM25 alone never finds it. Neighbours must pass the filters (`allowed`). Ties:
    lower rowid first.
    """
    if not keyword or weight == 0:
        return keyword
    n = entry.rowids.shape[0]
    scores = np.zeros(n, dtype=np.float64)  # [n]
    pos = entry.index_of(np.array([r for r, _ in keyword], dtype=np.int64))
    found = pos >= 0
    scores[pos[found]] = np.array([s for _, s in keyword], dtype=np.float64)[found]
    prev, nxt = entry.neighbours
    spread = np.maximum(np.where(prev >= 0, scores[prev], 0.0), np.where(nxt >= 0, scores[nxt], 0.0))
    total = scores + weight * spread  # [n]
    keep = total > 0
    if allowed is not None:
        keep &= np.isin(entry.rowids, allowed)
    idx = np.flatnonzero(keep)
    if limit is not None and limit < idx.shape[0]:
        # only rows scoring at least the limit-th best can be among the first `limit` (ties included), so
        # the sort below sees a few hundred rows, not every hit and neighbour
        kth = np.partition(total[idx], idx.shape[0] - limit)[idx.shape[0] - limit]
        idx = idx[total[idx] >= kth]
    order = idx[np.lexsort((entry.rowids[idx], -total[idx]))][:limit]
    return [(int(entry.rowids[i]), float(total[i])) for i in order]


def named_speakers(query: str, entry: UserVectors, rowids: list[int]) -> np.ndarray:
    """For each rowid, whether its speaker (the role's first word) is a word of the query. [len(rowids)] bool"""
    words = {w.lower() for w in _WORD_RE.findall(query)}
    if words.isdisjoint(entry.speaker_set):  # most queries name nobody the user's rows were said by
        return np.zeros(len(rowids), dtype=bool)
    pos = entry.index_of(np.array(rowids, dtype=np.int64))
    return np.array([p >= 0 and entry.speakers[p] in words for p in pos.tolist()], dtype=bool)


def lift(ranked: list[tuple[int, float]], mask: np.ndarray, weight: float) -> list[tuple[int, float]]:
    """Scores (s + weight * mask) / (1 + weight), re-sorted; ties keep their order. Stays in [0, 1]."""
    if weight == 0 or not mask.any():
        return ranked
    order = {r: i for i, (r, _) in enumerate(ranked)}
    lifted = [(r, (s + weight * bool(m)) / (1 + weight)) for (r, s), m in zip(ranked, mask, strict=True)]
    lifted.sort(key=lambda x: (-x[1], order[x[0]]))
    return lifted


def window_leg(
    entry: UserVectors | None, query_vector: np.ndarray, allowed: np.ndarray | None, limit: int
) -> list[tuple[int, float]]:
    """(rowid, windowed cosine) best first: the query's cosine with the normalized sum of a turn's vector and
    its previous and next turn's (the turn read with its neighbours), from the stored vectors, so indexing
    embeds nothing more. Ties: lower rowid first."""
    if entry is None or entry.rowids.shape[0] == 0:
        return []
    scores = dot_rows(entry.matrix, query_vector)  # [n]
    prev, nxt = entry.neighbours
    total = scores + np.where(prev >= 0, scores[prev], 0.0) + np.where(nxt >= 0, scores[nxt], 0.0)  # [n]
    total = total / _window_norms(entry)
    rowids = entry.rowids
    if allowed is not None:
        keep = np.isin(rowids, allowed)
        total, rowids = total[keep], rowids[keep]
    k = min(limit, total.shape[0])
    if k == 0:
        return []
    part = np.argpartition(-total, k - 1)[:k] if k < total.shape[0] else np.arange(total.shape[0])
    order = part[np.lexsort((rowids[part], -total[part]))]
    return [(int(rowids[i]), float(total[i])) for i in order]


_WINDOW_NORMS: dict[int, tuple[UserVectors, np.ndarray]] = {}


def _window_norms(entry: UserVectors) -> np.ndarray:
    """|v_prev + v + v_next| per row of `entry`, computed once per entry (a few entries are remembered)."""
    held = _WINDOW_NORMS.get(id(entry))
    if held is not None and held[0] is entry:
        return held[1]
    prev, nxt = entry.neighbours
    zeros = np.zeros_like(entry.matrix)
    window = entry.matrix + np.where((prev >= 0)[:, None], entry.matrix[np.maximum(prev, 0)], zeros)
    window += np.where((nxt >= 0)[:, None], entry.matrix[np.maximum(nxt, 0)], zeros)  # [n, dim]
    norms = np.maximum(np.linalg.norm(window, axis=1), 1e-6)  # [n]
    if len(_WINDOW_NORMS) >= 16:
        _WINDOW_NORMS.pop(next(iter(_WINDOW_NORMS)))
    _WINDOW_NORMS[id(entry)] = (entry, norms)
    return norms


@dataclass(frozen=True)
class Fused:
    """Hybrid's first stage: the fused ranking (rowid, score) best first, and each leg's 1-based ranks."""

    ranked: list[tuple[int, float]]
    keyword_rank: dict[int, int]
    dense_rank: dict[int, int]


def fuse_hybrid(
    keyword: list[tuple[int, float]],
    dense: list[tuple[int, float]],
    config: TextStoreConfig,
    entry: UserVectors | None = None,
    query: str = "",
    allowed: np.ndarray | None = None,
    in_time: np.ndarray | None = None,
    window: list[tuple[int, float]] | None = None,
) -> Fused:
    """Hybrid's first stage (see fuse_legs), with the ranks each leg gave its candidates."""
    if entry is not None:
        keyword = spread_to_neighbours(
            keyword, entry, config.neighbour_weight, allowed, config.num_candidates
        )
    keyword = keyword if config.keyword_weight > 0 else []  # a leg weighted 0 adds no zero-score rows
    dense = dense if config.dense_weight > 0 else []
    keyword_ids = [r for r, _ in keyword[: config.num_candidates]]
    dense_ids = [r for r, _ in dense[: config.num_candidates]]
    fused = reciprocal_rank_fusion(
        keyword_ids,
        dense_ids,
        config.rrf_k,
        config.keyword_weight,
        config.dense_weight,
        [r for r, _ in (window or [])[: config.num_candidates]],
        config.window_weight,
    )
    keyword_rank = {r: i for i, r in enumerate(keyword_ids, start=1)}
    dense_rank = {r: i for i, r in enumerate(dense_ids, start=1)}
    ranked = [(h.rowid, h.score) for h in fused]
    if entry is None or not ranked:
        return Fused(ranked, keyword_rank, dense_rank)
    if config.speaker_weight > 0:
        ranked = lift(ranked, named_speakers(query, entry, [r for r, _ in ranked]), config.speaker_weight)
    if in_time is not None and config.time_weight > 0:
        ranked = lift(
            ranked, np.isin(np.array([r for r, _ in ranked], dtype=np.int64), in_time), config.time_weight
        )
    return Fused(ranked, keyword_rank, dense_rank)


def fuse_legs(
    mode: str,
    keyword: list[tuple[int, float]],
    dense: list[tuple[int, float]],
    config: TextStoreConfig,
    entry: UserVectors | None = None,
    query: str = "",
    allowed: np.ndarray | None = None,
    in_time: np.ndarray | None = None,
) -> list[tuple[int, float]]:
    """The ranking `mode` asks for: one leg as it came, or (hybrid) both fused, scores in [0, 1].

    Hybrid: keyword hits spread to their neighbours (`spread_to_neighbours`), the top `num_candidates` of
    each leg fused by weighted RRF (scaled so first in both legs is 1.0), then, when the query names the
    speaker of some candidates, those are lifted: (rrf + speaker_weight * named) / (1 + speaker_weight);
    then, when the query names a time (`in_time`: the rowids whose chat_time is in it), candidates of that
    time are lifted the same way by time_weight.
    """
    assert mode in SEARCH_MODES, mode
    if mode == "keyword":
        return keyword
    if mode == "dense":
        return dense
    return fuse_hybrid(keyword, dense, config, entry, query, allowed, in_time).ranked


def rank_rows(
    conn: Any,
    vectors: VectorCache,
    dim: int,
    user_id: str,
    query: str,
    query_vector: np.ndarray | None,
    filters: SearchFilters,
    mode: str,
    top_k: int,
    config: TextStoreConfig,
    clock: Callable[[], datetime],
    include_superseded: bool = False,
    reranker: Reranker | None = None,
    keep_candidates: list[Candidates] | None = None,
) -> list[tuple[int, float]]:
    """(rowid, score) of this user's served memories (with `include_superseded`, active ones) for `query` in
    `mode`, best first, inside the caller's read snapshot. Hybrid reads the time the query names relative to
    `clock` (when.py); then, with a `reranker`, its top `rerank_depth` are reordered by it (the second
    stage; a RerankerUnavailable keeps the first stage's order, with a log line). Both legs, the BM25
    statistics and the neighbours come from the same rows (`user_rows`). `keep_candidates`, if given,
    receives the second stage's input (training and benchmarks)."""
    num_candidates = max(config.num_candidates, top_k)
    num_keyword = max(config.num_keyword_candidates, num_candidates) if mode == "hybrid" else num_candidates
    when = parse_query_time(query, clock) if mode == "hybrid" else None
    entry = user_rows(conn, vectors, dim, user_id, include_superseded)
    allowed = allowed_rowids(conn, user_id, filters)
    keyword: list[tuple[int, float]] = []
    if mode != "dense":
        words = query  # time words stay keywords too: "New Year 2024" is also what was said
        keyword = keyword_leg(conn, entry, user_id, words, allowed, num_keyword)
    in_time = None
    if when is not None:
        in_time = rowids_in_time(conn, user_id, when.start, when.later_by(config.time_slack_days).end)
    dense: list[tuple[int, float]] = []
    if mode != "keyword":
        spread = config.dense_neighbour_weight if mode == "hybrid" else 0.0
        dense = dense_leg(entry, query_vector, allowed, num_candidates, spread)
    if num_candidates != config.num_candidates:
        config = dataclasses.replace(config, num_candidates=num_candidates)
    if mode != "hybrid":
        return fuse_legs(mode, keyword, dense, config, entry, query, allowed, in_time)
    window = window_leg(entry, query_vector, allowed, num_candidates) if config.window_weight > 0 else None
    time_lift = in_time if config.time_weight > 0 else None
    fused = fuse_hybrid(keyword, dense, config, entry, query, allowed, time_lift, window)
    if entry is None or not fused.ranked or (reranker is None and keep_candidates is None):
        return fused.ranked
    legs = LegScores(keyword, fused.keyword_rank, fused.dense_rank, in_time, tuple(keyword_terms(query)))
    return second_stage(
        conn, fused.ranked, legs, entry, query_vector, query, config.rerank_depth, reranker, keep_candidates
    )
