"""Hybrid search pieces: the FTS5 keyword query and reciprocal rank fusion of ranked lists.

Owns how a chat message becomes an FTS5 MATCH expression and how two rankings become one. Pure functions;
knows nothing of SQLite connections or embeddings.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

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


def owner_token(user_id: str) -> str:
    """The FTS5 token that tags a user's rows, so a MATCH can be restricted to one user inside the index."""
    return "u" + hashlib.sha256(user_id.encode("utf-8")).hexdigest()[:24]


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


@dataclass(frozen=True)
class FusedHit:
    """A row after fusion, with its fused score and its 1-based rank in each leg (None: not retrieved)."""

    rowid: int
    score: float
    keyword_rank: int | None
    dense_rank: int | None


def reciprocal_rank_fusion(
    keyword: list[int], dense: list[int], k: int, keyword_weight: float, dense_weight: float
) -> list[FusedHit]:
    """RRF: score = sum over legs of weight / (k + rank), scaled so a row first in both legs scores 1.0.

    Ties are broken by the better single-leg rank, then by rowid, so the order is deterministic.
    """
    keyword_rank = {rowid: rank for rank, rowid in enumerate(keyword, start=1)}
    dense_rank = {rowid: rank for rank, rowid in enumerate(dense, start=1)}
    best = keyword_weight / (k + 1) + dense_weight / (k + 1)
    hits = []
    for rowid in dict.fromkeys([*keyword, *dense]):
        kr, dr = keyword_rank.get(rowid), dense_rank.get(rowid)
        score = (keyword_weight / (k + kr) if kr else 0.0) + (dense_weight / (k + dr) if dr else 0.0)
        hits.append(FusedHit(rowid=rowid, score=score / best, keyword_rank=kr, dense_rank=dr))
    hits.sort(key=lambda h: (-h.score, min(h.keyword_rank or 1 << 30, h.dense_rank or 1 << 30), h.rowid))
    return hits
