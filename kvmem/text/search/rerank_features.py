"""The second stage's inputs: what the first stage already knows about each of its top candidates, as numbers.

Owns the feature set (its name, version and column order: a weights file names the set it was fitted on, and
rerank.py refuses any other) and how one query's candidates become a [n, F] matrix from the legs' scores and
the per-user rows; also where a memory's speaker is read from. Knows nothing of models, weights or SQL.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from kvmem.text.search.vectors import UserVectors, dot_rows

FEATURE_SET = "kvmem-ltr-v1"
FEATURES = (
    "first_score",  # the first stage's fused score after its lifts, [0, 1]
    "first_rrank",  # 1 / the candidate's rank in the first stage
    "bm25",  # its own BM25 score / the best BM25 score of the query (0: no keyword hit)
    "keyword_rrank",  # 1 / rank in the neighbour-spread keyword leg (0: not in that leg's candidates)
    "neighbour_bm25",  # best BM25 of its previous / next turn / the best BM25 of the query
    "dense_cos",  # cosine of its vector with the query's
    "dense_rrank",  # 1 / rank in the neighbour-aware dense leg (0: not in that leg's candidates)
    "neighbour_cos",  # mean cosine of its previous and next turn (a missing one counts 0)
    "window_cos",  # cosine of the query with the normalized sum of previous, own and next vectors
    "dense_gap",  # dense_cos minus the best dense_cos among the candidates (<= 0)
    "time_match",  # its chat_time lies in the time the query names (0: none named)
    "speaker_match",  # its speaker is a word of the query
    "speaker_other",  # the query names a candidate's speaker, but not this one's
    "recency",  # its position among the user's rows, oldest 0 .. newest 1
    "log_length",  # log(1 + its length in words) / 5
    "term_overlap",  # share of the query's keyword terms found in its lower-cased text (as substrings)
    "is_question",  # its text ends with a question mark (questions rarely hold the answer)
    "wide_bm25",  # best BM25 of the turns up to WIDE turns before or after it in its session / the best
    "wide_cos",  # best cosine of the turns up to WIDE turns before or after it in its session
)
WIDE = 3
NUM_FEATURES = len(FEATURES)
_WORD_RE = re.compile(r"\w+", re.UNICODE)


def speaker_of(role: str | None, metadata: dict | None) -> str:
    """Who said a memory, as a lower-cased word matched against a query's words ('' if unknown).

    A `speaker` string in the memory's metadata wins (what an importer of multi-party logs knows, where every
    turn is role 'user'); otherwise the role's first word (chat messages whose role is the speaker's name).
    """
    value = metadata.get("speaker") if isinstance(metadata, dict) else None
    words = (value if isinstance(value, str) else role or "").split()
    return words[0].lower() if words else ""


@dataclass(frozen=True)
class LegScores:
    """What the first stage computed for one query, kept for the second stage.

    keyword: (rowid, BM25) before neighbour spreading, best first; spread_rank: rowid -> 1-based rank in the
    spread keyword leg's candidates; dense_rank: the same for the dense leg; in_time: rowids in the named time
    (None: no time named); terms: the query's keyword terms.
    """

    keyword: list[tuple[int, float]]
    spread_rank: dict[int, int]
    dense_rank: dict[int, int]
    in_time: np.ndarray | None
    terms: tuple[str, ...]


def _wide_positions(
    prev: np.ndarray, nxt: np.ndarray, chains: tuple[np.ndarray, np.ndarray], steps: int
) -> np.ndarray:
    """[n, 2 * steps] positions of the turns 1..steps before and after each candidate (-1: none), given its
    previous / next positions and the entry's (prev, next) chains."""
    all_prev, all_next = chains
    cols = []
    for start, chain in ((prev, all_prev), (nxt, all_next)):
        at = start
        for _ in range(steps):
            cols.append(at)
            at = np.where(at >= 0, chain[np.maximum(at, 0)], -1)
    return np.stack(cols, axis=1)


def candidate_features(
    ranked: list[tuple[int, float]],
    legs: LegScores,
    entry: UserVectors,
    query_vector: np.ndarray,
    query: str,
    texts: list[str],
) -> np.ndarray:
    """The [len(ranked), NUM_FEATURES] float64 matrix of the first stage's candidates `ranked` (best first,
    all rows of `entry`), columns in FEATURES order; `texts[i]` is candidate i's text."""
    n = len(ranked)
    out = np.zeros((n, NUM_FEATURES), dtype=np.float64)  # [n, F]
    if n == 0:
        return out
    rowids = np.fromiter((r for r, _ in ranked), dtype=np.int64, count=n)
    pos = entry.index_of(rowids)
    assert (pos >= 0).all(), "every candidate is a row of the entry"
    prev, nxt = entry.neighbours
    prev, nxt = prev[pos], nxt[pos]  # [n]
    col = {name: i for i, name in enumerate(FEATURES)}

    out[:, col["first_score"]] = [s for _, s in ranked]
    out[:, col["first_rrank"]] = 1.0 / np.arange(1, n + 1)

    num_rows = entry.rowids.shape[0]
    bm25 = np.zeros(num_rows + 1, dtype=np.float64)  # [n_rows + 1] by position; the last is "no row" (-1)
    if legs.keyword:
        hit_pos = entry.index_of(np.fromiter((r for r, _ in legs.keyword), dtype=np.int64))
        found = hit_pos >= 0
        bm25[hit_pos[found]] = np.fromiter((v for _, v in legs.keyword), dtype=np.float64)[found]
        bm25 /= bm25.max() or 1.0
    out[:, col["bm25"]] = bm25[pos]
    out[:, col["neighbour_bm25"]] = np.maximum(bm25[prev], bm25[nxt])  # -1 reads the zero at the end
    out[:, col["keyword_rrank"]] = [
        1.0 / legs.spread_rank[r] if r in legs.spread_rank else 0.0 for r in rowids.tolist()
    ]
    out[:, col["dense_rrank"]] = [
        1.0 / legs.dense_rank[r] if r in legs.dense_rank else 0.0 for r in rowids.tolist()
    ]

    # one gather for every vector the dense features read: the candidates' and their +-WIDE turns'
    wide = _wide_positions(
        prev, nxt, entry.neighbours, WIDE
    )  # [n, 2 * WIDE], -1: none; [:, 0] prev, [:, WIDE] next
    valid = wide >= 0  # [n, 2 * WIDE]
    rows = entry.matrix[np.concatenate([pos, np.maximum(wide, 0).ravel()])]  # [n * (1 + 2 * WIDE), dim]
    cos_all = dot_rows(rows, query_vector)  # [n * (1 + 2 * WIDE)]
    cos = cos_all[:n].astype(np.float64)  # [n]
    wide_cos = np.where(valid, cos_all[n:].reshape(n, 2 * WIDE), 0.0)  # [n, 2 * WIDE]
    cos_before, cos_after = wide_cos[:, 0], wide_cos[:, WIDE]
    around = rows[n:].reshape(n, 2 * WIDE, -1)  # [n, 2 * WIDE, dim]
    window = rows[:n] + around[:, 0] * valid[:, :1] + around[:, WIDE] * valid[:, WIDE : WIDE + 1]  # [n, dim]
    window_norm = np.maximum(np.linalg.norm(window, axis=1), 1e-6)
    out[:, col["dense_cos"]] = cos
    out[:, col["neighbour_cos"]] = (cos_before + cos_after) / 2
    out[:, col["window_cos"]] = (cos + cos_before + cos_after) / window_norm
    out[:, col["dense_gap"]] = cos - cos.max()
    out[:, col["wide_bm25"]] = bm25[wide].max(axis=1, initial=0.0)  # -1 reads the zero at the end
    out[:, col["wide_cos"]] = wide_cos.max(axis=1, initial=0.0)
    if legs.in_time is not None:
        out[:, col["time_match"]] = np.isin(rowids, legs.in_time)
    words = {w.lower() for w in _WORD_RE.findall(query)}
    speakers = entry.speakers[pos]
    named = np.array([bool(s) and s in words for s in speakers.tolist()], dtype=bool)
    out[:, col["speaker_match"]] = named
    if named.any():
        out[:, col["speaker_other"]] = ~named
    out[:, col["recency"]] = pos / max(num_rows - 1, 1)
    out[:, col["log_length"]] = np.log1p(entry.lengths[pos].astype(np.float64)) / 5.0
    terms = legs.terms
    if terms:  # a term counts where it starts a word or sits inside one ("hik" in "hiking"): cheap stemming
        out[:, col["term_overlap"]] = [
            sum(term in low for term in terms) / len(terms) for low in (t.lower() for t in texts)
        ]
    out[:, col["is_question"]] = [t.rstrip().endswith("?") for t in texts]
    assert np.isfinite(out).all(), "features are finite"
    return out
