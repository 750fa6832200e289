"""The search path's shortcuts return exactly what the plain path returned: the blocked vector scan, the
rowid lookup of hits, and the per-user caches (kept in step with writes, this process's and others')."""

from __future__ import annotations

import numpy as np
import pytest

from kvmem.text.db.rows import active_by_rowids
from kvmem.text.search.vectors import BLOCK_ALIGN_ROWS, dot_rows
from tests.kvmem.text.conftest import open_store


@pytest.mark.parametrize("num_rows", [0, 1, 63, 64, 300, 639, 640, 641, 1400, 1403, 10_000, 10_001])
def test_dot_rows_is_bitwise_the_one_thread_product(num_rows):
    rng = np.random.default_rng(num_rows)
    matrix = rng.standard_normal((num_rows, 384)).astype(np.float32)  # [n, 384]
    matrix /= np.maximum(np.linalg.norm(matrix, axis=1, keepdims=True), 1e-6)
    query = rng.standard_normal(384).astype(np.float32)
    # products of BLOCK_ALIGN_ROWS rows are far below BLAS's threading threshold: the one-thread result
    one_thread = [matrix[i : i + BLOCK_ALIGN_ROWS] @ query for i in range(0, num_rows, BLOCK_ALIGN_ROWS)]
    expected = np.concatenate(one_thread) if one_thread else np.zeros(0, dtype=np.float32)
    got = dot_rows(matrix, query)
    assert got.dtype == np.float32 and got.shape == (num_rows,)
    assert np.array_equal(got, expected)
    if num_rows <= 640:  # one block: the plain product
        assert np.array_equal(got, matrix @ query)


def test_hits_are_looked_up_by_rowid_and_stay_the_users(store):
    [a1, a2] = store.add("alice", texts=["alpha one", "alpha two"])
    [b1] = store.add("bob", "alpha bob")
    rowids = dict(store._conn().execute("SELECT id, rowid FROM memories").fetchall())
    store.update("alice", a2.id, state="archived")
    found = active_by_rowids(store._conn(), "alice", [rowids[a1.id], rowids[a2.id], rowids[b1.id]])
    assert {r: m.id for r, m in found.items()} == {rowids[a1.id]: a1.id}  # not archived, not bob's
    found = active_by_rowids(store._conn(), "bob", [rowids[a1.id], rowids[b1.id]])
    assert [m.id for m in found.values()] == [b1.id]


def test_hits_lookup_keeps_superseded_rows_only_when_asked(store_location, clock):
    with open_store(store_location, clock=clock) as store:
        [old, new] = store.add("alice", texts=["lives in Paris", "lives in Rome"])
        store.supersede("alice", old.id, new.id)
        rowids = dict(store._conn().execute("SELECT id, rowid FROM memories").fetchall())
        ids = [rowids[old.id], rowids[new.id]]
        assert [m.id for m in active_by_rowids(store._conn(), "alice", ids).values()] == [new.id]
        both = active_by_rowids(store._conn(), "alice", ids, include_superseded=True)
        assert sorted(m.id for m in both.values()) == sorted([old.id, new.id])


# ----------------------------------------------------------------- the per-user term cache


def _ranked(store, user, query, mode):
    return [(h.memory.id, h.score) for h in store.search(user, query, top_k=50, mode=mode)]


QUERIES = [
    "running shoes",
    "the cat ran",
    "cats and dogs",
    "snake_case words",
    "weird \x01 mark",
    "café",
    "zebra",
    "shoes shoes cat",
]


def _same_as_a_fresh_store(location, clock, warm, user="alice"):
    """Every query's keyword and hybrid ranking from `warm` (caches in use) equals a store opened now."""
    with open_store(location, clock=clock) as fresh:
        for query in QUERIES:
            for mode in ("keyword", "hybrid"):
                assert _ranked(warm, user, query, mode) == _ranked(fresh, user, query, mode), (query, mode)


def test_term_cache_returns_what_the_index_returns_through_writes(store_location, clock):
    with open_store(store_location, clock=clock) as one, open_store(store_location, clock=clock) as two:
        one.add("alice", texts=["I was running in new shoes", "the cat ran away", "shoes shoes shoes"])
        one.add("alice", "snake_case words and snake case", session_id="s1")
        one.add("bob", "running cats")
        for query in QUERIES:  # fills the term caches
            _ranked(one, "alice", query, "hybrid")
        _same_as_a_fresh_store(store_location, clock, one)
        [dog] = one.add("alice", "Cats and dogs, running", session_id="s1")  # carried over, extended
        assert one._vectors.get("alice", _gen(one, "alice")).terms is not None
        _same_as_a_fresh_store(store_location, clock, one)
        one.add("alice", "a weird \x01 mark next to the cat")  # \x01: the cache starts over
        _same_as_a_fresh_store(store_location, clock, one)
        two.add("alice", "another process says cat and café")  # another process: a new generation
        _same_as_a_fresh_store(store_location, clock, one)
        one.update("alice", dog.id, text="zebra crossing, no shoes")
        _same_as_a_fresh_store(store_location, clock, one)
        two.update("alice", dog.id, state="archived")
        _same_as_a_fresh_store(store_location, clock, one)
        two.delete("alice", one.search("alice", "cat", mode="keyword")[0].memory.id)
        _same_as_a_fresh_store(store_location, clock, one)
        _same_as_a_fresh_store(store_location, clock, one, user="bob")


def test_term_cache_is_carried_over_only_by_this_processs_adds(store_location, clock):
    with open_store(store_location, clock=clock) as one, open_store(store_location, clock=clock) as two:
        one.add("alice", texts=["cat one", "cat two"])
        one.search("alice", "cat", mode="keyword")
        cache = one._vectors.get("alice", _gen(one, "alice")).terms
        assert cache.get("cat").positions.tolist() == [0, 1]
        one.add("alice", "a third cat, cats")
        cache = one._vectors.get("alice", _gen(one, "alice")).terms
        assert cache.get("cat").positions.tolist() == [0, 1, 2]
        assert cache.get("cat").counts.tolist() == [1.0, 1.0, 2.0]  # "cats" stems to "cat"
        two.add("alice", "cat four")
        assert one._vectors.get("alice", _gen(one, "alice")) is None  # another process's write retires it
        assert len(one.search("alice", "cat", mode="keyword")) == 4


def _gen(store, user):
    return store._conn().execute("SELECT gen FROM user_generation WHERE user_id = ?", (user,)).fetchone()[0]


def test_term_cache_is_bounded_in_bytes():
    from kvmem.text.search.term_cache import TermCache, term_matches

    def matches(n):
        return term_matches(np.arange(n), np.ones(n), "t")

    cache = TermCache(max_bytes=3 * TermCache.size_of(matches(10)))
    for term in "abcd":
        cache.put(term, matches(10))
    assert len(cache) == 3 and cache.get("a") is None  # least recently used goes first
    cache.get("b")
    cache.put("e", matches(10))
    assert cache.get("c") is None and cache.get("b") is not None
    cache.put("huge", matches(10_000))  # over the whole bound: not kept
    assert cache.get("huge") is None and len(cache) == 3


def test_term_cache_holds_at_most_max_terms():
    from kvmem.text.search.term_cache import MAX_TERMS, TermCache, term_matches

    cache = TermCache(max_bytes=1 << 30)
    for i in range(MAX_TERMS + 10):
        cache.put(f"t{i}", term_matches(np.arange(1), np.ones(1), f"t{i}"))
    assert len(cache) == MAX_TERMS and cache.get("t9") is None and cache.get("t10") is not None
    carried = cache.extended(5, ["t10 and t11 and t11"], max_bytes=1 << 30)
    assert len(carried) == MAX_TERMS
    assert carried.get("t11").positions.tolist() == [0, 5] and carried.get("t11").counts.tolist() == [1, 2]


def test_entry_bytes_count_the_term_cache_bound():
    from kvmem.text.search.vectors import MIN_TERM_CACHE_BYTES, UserVectors

    n = 10_000
    entry = UserVectors(
        gen=1,
        rowids=np.arange(n, dtype=np.int64),
        matrix=np.zeros((n, 384), dtype=np.float32),
        sessions=np.array([None] * n, dtype=object),
        speakers=np.array([""] * n, dtype=object),
        lengths=np.ones(n, dtype=np.int64),
    )
    assert entry.terms.max_bytes == max(MIN_TERM_CACHE_BYTES, n * 384 * 4 // 8)
    assert entry.num_bytes == n * 8 + n * 384 * 4 + 64 * n + entry.terms.max_bytes


def test_spread_with_a_limit_is_the_head_of_the_full_spread_ties_included():
    from kvmem.text.search.hybrid import spread_to_neighbours
    from kvmem.text.search.vectors import UserVectors

    rng = np.random.default_rng(0)
    n = 400
    entry = UserVectors(
        gen=1,
        rowids=np.arange(100, 100 + n, dtype=np.int64),
        matrix=np.zeros((n, 4), dtype=np.float32),
        sessions=np.array([f"s{i // 7}" for i in range(n)], dtype=object),
        speakers=np.array([""] * n, dtype=object),
        lengths=np.ones(n, dtype=np.int64),
    )
    rows = rng.choice(n, 150, replace=False)
    keyword = [(100 + int(r), float(rng.integers(1, 4))) for r in rows]  # few distinct scores: many ties
    for allowed in (None, np.arange(100, 100 + n, 2, dtype=np.int64)):
        full = spread_to_neighbours(keyword, entry, 0.5, allowed)
        for limit in (1, 7, 50, 100, len(full), len(full) + 5):
            assert spread_to_neighbours(keyword, entry, 0.5, allowed, limit) == full[:limit], limit


def test_a_speaker_set_by_a_metadata_update_reaches_a_warm_store(store_location, clock):
    """The cached rows hold each row's speaker (metadata 'speaker' first): an update that changes it retires
    them, as a text update does."""
    with open_store(store_location, clock=clock) as one, open_store(store_location, clock=clock) as two:
        [first, second] = one.add("alice", texts=["we ate pizza", "pizza again tonight"])
        query = "What pizza did Carla eat?"
        before = _ranked(one, "alice", query, "hybrid")  # caches the rows, no speaker named
        for store in (one, two):  # this process, then another one
            target = second if store is one else first
            store.update("alice", target.id, metadata={"speaker": "Carla"})
            with open_store(store_location, clock=clock) as fresh:
                assert _ranked(one, "alice", query, "hybrid") == _ranked(fresh, "alice", query, "hybrid")
        assert _ranked(one, "alice", query, "hybrid") != before


def test_forget_terms_empties_the_term_caches_and_keeps_the_rows(store):
    store.add("alice", texts=["cat one", "cat two"])
    hits = _ranked(store, "alice", "cat", "hybrid")
    entry = store._vectors.get("alice", _gen(store, "alice"))
    assert len(entry.terms) == 1
    store._vectors.forget_terms()
    assert len(entry.terms) == 0 and store._vectors.get("alice", _gen(store, "alice")) is entry
    assert _ranked(store, "alice", "cat", "hybrid") == hits


def test_named_speakers_with_and_without_a_named_speaker():
    from kvmem.text.search.hybrid import named_speakers
    from kvmem.text.search.vectors import UserVectors

    speakers = ["ana", "", "ben", "ana"]
    entry = UserVectors(
        gen=1,
        rowids=np.array([10, 11, 12, 13], dtype=np.int64),
        matrix=np.zeros((4, 4), dtype=np.float32),
        sessions=np.array(["s"] * 4, dtype=object),
        speakers=np.array(speakers, dtype=object),
        lengths=np.ones(4, dtype=np.int64),
    )
    assert entry.speaker_set == {"ana", "ben", ""}
    assert named_speakers("what did Ana say?", entry, [13, 12, 10, 99]).tolist() == [True, False, True, False]
    assert named_speakers("what did Carla say?", entry, [13, 12, 10, 99]).tolist() == [False] * 4
    assert named_speakers("BEN", entry, [11, 12]).tolist() == [False, True]
