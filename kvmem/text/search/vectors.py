"""Exact dense search: per-user vector matrices cached in process, scanned with numpy.

Owns the cache and its invalidation, and the per-row facts search needs beside the vectors: each row's
session and speaker, and its neighbours in the conversation (the previous and next active row of the same
session), derived from live rows only, so a deleted memory is never anyone's neighbour. Each user's write bumps `user_generation.gen` in the same transaction,
so a cached matrix is used only while its generation is the file's (other threads and processes included).
sqlite-vec would need an extension-capable SQLite; an exact scan of one user's vectors is fast enough here.
Knows nothing of filters or fusion.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from kvmem.text.search.term_cache import TermCache

# An entry's term cache holds at most an eighth of its matrix's bytes (~1.9 MB for 10k rows of 384), at least
# this; the bound is counted in the entry's num_bytes, so VectorCache's byte bound covers it.
MIN_TERM_CACHE_BYTES = 64 * 1024


def term_cache_bytes(matrix: np.ndarray) -> int:
    return max(MIN_TERM_CACHE_BYTES, matrix.nbytes // 8)


@dataclass(frozen=True)
class UserVectors:
    """One user's active vectors at one generation. rowids[i] (ascending) is the memory row of matrix[i];
    sessions[i] its session id (None: none), speakers[i] its speaker (rerank_features.speaker_of) and lengths[i] its text's length in
    words (bm25.num_tokens), from which keyword search takes the user's own average length. `terms` holds
    the keyword index's answers for these rows (term_cache.py): current exactly as long as the entry."""

    gen: int
    rowids: np.ndarray  # [n] int64, ascending
    matrix: np.ndarray  # [n, dim] float32
    sessions: np.ndarray  # [n] object (str | None)
    speakers: np.ndarray  # [n] object (str)
    lengths: np.ndarray  # [n] int64
    terms: TermCache | None = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.terms is None:
            object.__setattr__(self, "terms", TermCache(term_cache_bytes(self.matrix)))

    @property
    def num_bytes(self) -> int:
        assert self.terms is not None
        return self.rowids.nbytes + self.matrix.nbytes + 64 * self.rowids.shape[0] + self.terms.max_bytes

    @functools.cached_property
    def neighbours(self) -> tuple[np.ndarray, np.ndarray]:
        """(prev, next): index of the previous / next row of the same session in insertion (rowid) order,
        -1 where there is none or the row has no session. Computed once per entry, on first use."""
        n = self.rowids.shape[0]
        prev = np.full(n, -1, dtype=np.int64)  # [n]
        nxt = np.full(n, -1, dtype=np.int64)  # [n]
        last: dict[str, int] = {}
        for i, session in enumerate(self.sessions.tolist()):
            if session is None:
                continue
            j = last.get(session)
            if j is not None:
                prev[i], nxt[j] = j, i
            last[session] = i
        return prev, nxt

    @functools.cached_property
    def speaker_set(self) -> frozenset[str]:
        """The distinct speakers of these rows ('' included when some row has none); computed once."""
        return frozenset(self.speakers.tolist())

    def index_of(self, rowids: np.ndarray) -> np.ndarray:
        """Positions of these rowids in this entry, -1 for rowids it does not hold."""
        rowids = np.asarray(rowids, dtype=np.int64)
        if self.rowids.shape[0] == 0:
            return np.full(rowids.shape[0], -1, dtype=np.int64)
        pos = np.minimum(np.searchsorted(self.rowids, rowids), self.rowids.shape[0] - 1)
        return np.where(self.rowids[pos] == rowids, pos, -1)


class VectorCache:
    """LRU of UserVectors bounded in bytes. Thread-safe; entries are immutable, replaced never mutated."""

    def __init__(self, max_bytes: int) -> None:
        self._max_bytes = max_bytes
        self._entries: OrderedDict[str, UserVectors] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, user_id: str, gen: int) -> UserVectors | None:
        with self._lock:
            entry = self._entries.get(user_id)
            if entry is None or entry.gen != gen:
                return None
            self._entries.move_to_end(user_id)
            return entry

    def put(self, user_id: str, entry: UserVectors) -> None:
        with self._lock:
            self._drop(user_id)
            if entry.num_bytes > self._max_bytes:
                return
            self._entries[user_id] = entry
            self._bytes += entry.num_bytes
            while self._bytes > self._max_bytes:
                self._drop(next(iter(self._entries)))

    def append(
        self,
        user_id: str,
        old_gen: int,
        new_gen: int,
        rowids: np.ndarray,
        matrix: np.ndarray,
        sessions: list[str | None],
        speakers: list[str],
        lengths: list[int],
        texts: list[str] | None = None,
    ) -> None:
        """After this process's own add: extend the entry if it was current at `old_gen`, else drop it.

        New rowids are larger than every cached one (SQLite rowids grow), so the order stays ascending. With
        the new rows' `texts`, the entry's term cache is carried over (TermCache.extended); else it starts empty.
        """
        with self._lock:
            entry = self._entries.get(user_id)
        if entry is None:
            return
        if entry.gen != old_gen:
            self.invalidate(user_id)
            return
        matrix = np.concatenate([entry.matrix, matrix.astype(np.float32)])
        assert entry.terms is not None
        terms = None
        if texts is not None:
            terms = entry.terms.extended(entry.rowids.shape[0], texts, term_cache_bytes(matrix))
        self.put(
            user_id,
            UserVectors(
                gen=new_gen,
                rowids=np.concatenate([entry.rowids, rowids.astype(np.int64)]),
                matrix=matrix,
                sessions=np.concatenate([entry.sessions, np.array(sessions, dtype=object)]),
                speakers=np.concatenate([entry.speakers, np.array(speakers, dtype=object)]),
                lengths=np.concatenate([entry.lengths, np.array(lengths, dtype=np.int64)]),
                terms=terms,
            ),
        )

    def invalidate(self, user_id: str) -> None:
        with self._lock:
            self._drop(user_id)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    def forget_terms(self) -> None:
        """Empties every entry's term cache (the rows stay): what a query whose words are all new costs,
        for benchmarks."""
        with self._lock:
            entries = list(self._entries.values())
        for entry in entries:
            assert entry.terms is not None
            entry.terms.clear()

    def _drop(self, user_id: str) -> None:
        entry = self._entries.pop(user_id, None)
        if entry is not None:
            self._bytes -= entry.num_bytes


# `dot_rows` computes at most 2^18 float32 elements (1 MiB, an L2's worth) per matrix-vector product, in a
# whole number of BLOCK_ALIGN_ROWS rows (BLAS kernels take rows in groups; see dot_rows).
BLOCK_ELEMENTS = 1 << 18
BLOCK_ALIGN_ROWS = 64


def dot_rows(matrix: np.ndarray, query: np.ndarray) -> np.ndarray:
    """matrix @ query, [n] float32, computed in blocks of at most BLOCK_ELEMENTS.

    Why blocks: OpenBLAS hands a matrix-vector product above ~460k elements (1.2k rows of 384) to its worker
    threads, and on a busy 2-core host their fork/join cost 5-20 ms per 10k-row scan against ~1 ms on one
    thread; each block stays under that threshold. Blocks start on multiples of BLOCK_ALIGN_ROWS, so the BLAS
    kernel groups rows as it does over the whole matrix on one thread: the result is bitwise that of
    `matrix @ query` on one BLAS thread, whatever the thread count (with several threads `matrix @ query`
    itself differs in the last bit for some row counts, where a thread's share splits a row group).
    """
    query = query.astype(np.float32)
    n = matrix.shape[0]
    rows = BLOCK_ELEMENTS // max(matrix.shape[1], 1)
    step = max(BLOCK_ALIGN_ROWS, rows - rows % BLOCK_ALIGN_ROWS)
    if n <= step:
        return matrix @ query
    out = np.empty(n, dtype=np.float32)  # [n]
    for start in range(0, n, step):
        np.matmul(matrix[start : start + step], query, out=out[start : start + step])
    return out


def top_k_by_dot(
    vectors: UserVectors,
    query: np.ndarray,
    k: int,
    allowed: np.ndarray | None = None,
    neighbour_weight: float = 0.0,
) -> list[tuple[int, float]]:
    """(rowid, score) of the k best rows, best first; `allowed` restricts to those rowids. Ties: lower rowid.

    score = cosine, plus `neighbour_weight` times the mean cosine of the previous and next turn of the same
    session (a missing neighbour counts 0): a reply is found by what it answers.
    """
    if vectors.matrix.shape[0] == 0 or k <= 0:
        return []
    scores = dot_rows(vectors.matrix, query)  # [n]
    if neighbour_weight:
        prev, nxt = vectors.neighbours
        around = np.where(prev >= 0, scores[prev], 0.0) + np.where(nxt >= 0, scores[nxt], 0.0)  # [n]
        scores = scores + np.float32(neighbour_weight / 2) * around.astype(np.float32)
    rowids = vectors.rowids
    if allowed is not None:
        keep = np.isin(rowids, allowed)
        scores, rowids = scores[keep], rowids[keep]
        if scores.shape[0] == 0:
            return []
    if k < scores.shape[0]:
        part = np.argpartition(-scores, k - 1)[:k]
    else:
        part = np.arange(scores.shape[0])
    order = part[np.lexsort((rowids[part], -scores[part]))]
    return [(int(rowids[i]), float(scores[i])) for i in order]
