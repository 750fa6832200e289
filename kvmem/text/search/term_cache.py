"""The keyword index's answers for one user's cached rows, kept per query term while those rows are current.

Owns `TermCache`: for a query term, the positions (in a `UserVectors` entry) of the rows holding it and their
term frequencies, exactly as the keyword index returned them (bm25.term_frequencies, kept to the entry's
rows). Why: on SQLite each term costs an FTS5 MATCH whose highlight() re-reads and re-tokenizes every matching
row (~1 ms per thousand matches), and a user's questions share words. A cache lives inside one entry, so it is
current exactly while the entry is (the user's generation: every write to the user's index rows bumps it);
after this process's own add it is carried over with the new rows' matches (`extended`). Bounded in bytes and terms.
Knows nothing of SQL, BM25 or ranking.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import NamedTuple

import numpy as np

from kvmem.text.search.terms import term_counts

# Per-term bookkeeping counted against the bound besides the arrays (dict slot, tuple, two array headers).
_TERM_OVERHEAD_BYTES = 320
# At most this many terms per cache, whatever their bytes: carrying a cache over to an add's entry visits each.
MAX_TERMS = 512


class TermMatches(NamedTuple):
    """One query term's rows in an entry: positions ascending, term frequencies as the index counted them."""

    positions: np.ndarray  # [k] int64, read-only
    counts: np.ndarray  # [k] float64, read-only
    token: str | None  # the one stemmed token the term is (None: a phrase or no token; not carried over)


def single_tokens(terms: list[str]) -> list[str | None]:
    """For each query word, the stemmed token it is when FTS5 reads it as exactly one token, else None."""
    out: list[str | None] = []
    for counts in term_counts(terms):
        out.append(next(iter(counts)) if sum(counts.values()) == 1 else None)
    return out


def term_matches(positions: np.ndarray, counts: np.ndarray, token: str | None) -> TermMatches:
    positions = np.asarray(positions, dtype=np.int64)
    counts = np.asarray(counts, dtype=np.float64)
    positions.setflags(write=False)
    counts.setflags(write=False)
    return TermMatches(positions, counts, token)


class TermCache:
    """LRU of query term -> TermMatches, bounded in bytes (16 bytes a match plus a per-term overhead) and in
    terms (MAX_TERMS). Thread-safe; values are immutable."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, TermMatches] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    @staticmethod
    def size_of(matches: TermMatches) -> int:
        return matches.positions.nbytes + matches.counts.nbytes + _TERM_OVERHEAD_BYTES

    def get(self, term: str) -> TermMatches | None:
        with self._lock:
            found = self._entries.get(term)
            if found is not None:
                self._entries.move_to_end(term)
            return found

    def put(self, term: str, matches: TermMatches) -> None:
        size = self.size_of(matches)
        with self._lock:
            old = self._entries.pop(term, None)
            if old is not None:
                self._bytes -= self.size_of(old)
            if size > self.max_bytes:
                return
            self._entries[term] = matches
            self._bytes += size
            while self._bytes > self.max_bytes or len(self._entries) > MAX_TERMS:
                _, dropped = self._entries.popitem(last=False)
                self._bytes -= self.size_of(dropped)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def extended(self, start: int, texts: list[str], max_bytes: int) -> TermCache:
        """The cache of the entry that adds rows start, start + 1, ... holding `texts` to this one's rows.

        Terms that are one token gain the new rows holding it, counted as FTS5 counts (its own tokenizer:
        terms.py); phrases are dropped (recomputed on their next use). If a new text holds a \\x01, nothing is
        carried over: SQLite's highlight() counted that character as a match mark, which this count does not.
        """
        out = TermCache(max_bytes)
        with self._lock:
            items = list(self._entries.items())  # least recently used first, as they are put back
        if not items or any("\x01" in text for text in texts):
            return out
        new_rows: dict[str, list[tuple[int, int]]] = {}  # stemmed token -> [(position, instances)]
        for i, counts in enumerate(term_counts(texts)):
            for token, num in counts.items():
                new_rows.setdefault(token, []).append((start + i, num))
        for term, matches in items:
            if matches.token is None:
                continue
            hits = new_rows.get(matches.token)
            if hits:
                positions = np.array([p for p, _ in hits], dtype=np.int64)
                counts = np.array([n for _, n in hits], dtype=np.float64)
                matches = term_matches(
                    np.concatenate([matches.positions, positions]),
                    np.concatenate([matches.counts, counts]),
                    matches.token,
                )
            out.put(term, matches)
        return out
