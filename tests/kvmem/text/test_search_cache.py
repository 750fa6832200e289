"""The search path's shortcuts return exactly what the plain path returned: the blocked vector scan, the
rowid lookup of hits, and the per-user caches (kept in step with writes, this process's and others')."""

from __future__ import annotations

import numpy as np
import pytest

from kvmem.text.rows import active_by_rowids
from kvmem.text.vectors import BLOCK_ALIGN_ROWS, dot_rows
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
