"""Search plumbing with the deterministic hash embedder (dense quality is tested with the real model)."""

from __future__ import annotations

import dataclasses

from kvmem.text import SearchFilters, TimeRange
from kvmem.text.search.hybrid import fts_match_expression, keyword_terms, reciprocal_rank_fusion


def test_keyword_terms_drop_stopwords():
    assert keyword_terms("What is the name of my pet?") == ["name", "pet"]
    assert keyword_terms("what is it?") == ["what", "is", "it"]
    assert keyword_terms("?!") == []


def test_fts_expression_is_scoped_to_the_user_and_quoted():
    expr = fts_match_expression("alice", 'apple "pie" OR crust*')
    assert expr.startswith('owner : "u') and expr.endswith(' AND text : ("apple" OR "pie" OR "crust")')
    assert fts_match_expression("alice", "...") is None


def test_rrf_scores_and_ties():
    hits = reciprocal_rank_fusion([1, 2, 3], [2, 4], k=5, keyword_weight=0.5, dense_weight=1.0)
    assert [h.rowid for h in hits] == [2, 4, 1, 3]
    top = 0.5 / 6 + 1.0 / 6
    assert hits[0].score == (0.5 / 7 + 1.0 / 6) / top
    assert (hits[0].keyword_rank, hits[0].dense_rank) == (2, 1)
    assert reciprocal_rank_fusion([7], [7], 5, 0.5, 1.0)[0].score == 1.0


def test_keyword_search_ranks_bm25(store):
    a, b, _ = store.add("alice", texts=["the red fox", "red red red fox jumps", "a blue whale"])
    hits = store.search("alice", "red fox", mode="keyword")
    assert [h.memory.id for h in hits] == [b.id, a.id]
    assert hits[0].score > hits[1].score > 0


def test_porter_stemming(store):
    [m] = store.add("alice", "I adopted a beagle named Max")
    assert [
        h.memory.id for h in store.search("alice", "what name did the adopting go with", mode="keyword")
    ] == [m.id]


def test_search_is_per_user(store):
    [a] = store.add("alice", "shared words here")
    [b] = store.add("bob", "shared words here")
    for mode in ("keyword", "dense", "hybrid"):
        assert [h.memory.id for h in store.search("alice", "shared words", mode=mode)] == [a.id]
        assert [h.memory.id for h in store.search("bob", "shared words", mode=mode)] == [b.id]
        assert store.search("carol", "shared words", mode=mode) == []


def test_hybrid_fuses_both_legs(store):
    a, b = store.add("alice", texts=["zebra crossing downtown", "completely unrelated sentence"])
    hits = store.search("alice", "zebra", top_k=2)
    assert [h.memory.id for h in hits] == [a.id, b.id]
    assert 0 < hits[1].score < hits[0].score < 1  # the second stage's scores
    store.config = dataclasses.replace(store.config, rerank="none")
    hits = store.search("alice", "zebra", top_k=2)
    assert [h.memory.id for h in hits] == [a.id, b.id]
    assert hits[0].score == 1.0  # first in both legs
    assert 0 < hits[1].score < 1


def test_top_k_and_min_score(store):
    ids = [m.id for m in store.add("alice", texts=[f"apple number {i}" for i in range(5)])]
    assert len(store.search("alice", "apple", top_k=3)) == 3
    hits = store.search("alice", "apple", top_k=5, mode="dense")
    assert {h.memory.id for h in hits} == set(ids)
    cut = hits[2].score
    kept = store.search("alice", "apple", top_k=5, mode="dense", min_score=cut)
    assert [h.memory.id for h in kept] == [h.memory.id for h in hits if h.score >= cut]
    assert store.search("alice", "apple", min_score=1.01) == []


def test_filters_apply_to_every_mode(store):
    a = store.add(
        "alice",
        "trip to Peru",
        session_id="s1",
        tags=["travel"],
        metadata={"k": "v"},
        chat_time="2024-01-10T00:00:00Z",
    )[0]
    b = store.add(
        "alice", "trip to Chile", session_id="s2", tags=["travel", "later"], chat_time="2024-06-10T00:00:00Z"
    )[0]
    cases = [
        ({"session_id": "s2"}, [b.id]),
        ({"tags": ["later"]}, [b.id]),
        ({"metadata": {"k": "v"}}, [a.id]),
        ({"time_range": {"start": "2024-01-01T00:00:00Z", "end": "2024-02-01T00:00:00Z"}}, [a.id]),
        ({"time_range": {"start": "2024-05-01T00:00:00Z"}}, [b.id]),
        (SearchFilters(time_range=TimeRange(end="2024-01-09T00:00:00.000000Z")), []),
    ]
    for mode in ("keyword", "dense", "hybrid"):
        for filters, expected in cases:
            assert [
                h.memory.id for h in store.search("alice", "trip", filters=filters, mode=mode)
            ] == expected, (mode, filters)


def test_vector_cache_follows_writes(store):
    [a] = store.add("alice", "first note about cats")
    assert [h.memory.id for h in store.search("alice", "cats", mode="dense")] == [a.id]  # loads the cache
    [b] = store.add("alice", "second note about dogs")  # appended to the cached matrix
    assert {h.memory.id for h in store.search("alice", "dogs", mode="dense")} == {a.id, b.id}
    store.update("alice", b.id, text="second note about birds")
    hits = store.search("alice", "birds", mode="dense")
    assert hits[0].memory.id == b.id and hits[0].memory.text == "second note about birds"
    store.delete("alice", a.id)
    assert [h.memory.id for h in store.search("alice", "cats", mode="dense")] == [b.id]


def test_vector_cache_sees_other_processes_writes(store_location, clock):
    from kvmem.text import HashEmbedder, MemoryStore

    with (
        MemoryStore(store_location, embedder=HashEmbedder(), clock=clock) as one,
        MemoryStore(store_location, embedder=HashEmbedder(), clock=clock) as two,
    ):
        [a] = one.add("alice", "apples")
        assert [h.memory.id for h in two.search("alice", "apples", mode="dense")] == [a.id]
        [b] = one.add("alice", "pears")
        assert {h.memory.id for h in two.search("alice", "pears", mode="dense")} == {a.id, b.id}
        one.delete("alice", a.id)
        assert [h.memory.id for h in two.search("alice", "pears", mode="dense")] == [b.id]


# ----------------------------------------------------------------- conversational context in hybrid search


def _rows(sessions, speakers=None):
    import numpy as np

    from kvmem.text.search.vectors import UserVectors

    n = len(sessions)
    return UserVectors(
        gen=1,
        rowids=np.arange(10, 10 + n, dtype=np.int64),
        matrix=np.zeros((n, 4), dtype=np.float32),
        sessions=np.array(sessions, dtype=object),
        speakers=np.array(speakers or [""] * n, dtype=object),
        lengths=np.ones(n, dtype=np.int64),
    )


def test_neighbours_stay_inside_a_session():
    rows = _rows(["a", "b", "a", None, "a"])
    prev, nxt = rows.neighbours
    assert prev.tolist() == [-1, -1, 0, -1, 2]
    assert nxt.tolist() == [2, -1, 4, -1, -1]
    assert rows.index_of([12, 99, 10]).tolist() == [2, -1, 0]


def test_spread_to_neighbours_exact_scores():
    import numpy as np

    from kvmem.text.search.hybrid import spread_to_neighbours

    rows = _rows(["a", "a", "a", "b", "b"])  # rowids 10..14
    spread = spread_to_neighbours([(11, 4.0), (13, 2.0)], rows, 0.5, None)
    # 11 keeps 4; its neighbours 10 and 12 get 0.5 * 4; 13 keeps 2, its neighbour 14 gets 1; ties by rowid
    assert spread == [(11, 4.0), (10, 2.0), (12, 2.0), (13, 2.0), (14, 1.0)]
    # a neighbour outside the filters is not added; the hits themselves passed the filters in SQL
    assert spread_to_neighbours([(11, 4.0)], rows, 0.5, np.array([11, 12])) == [(11, 4.0), (12, 2.0)]
    assert spread_to_neighbours([(11, 4.0)], rows, 0.0, None) == [(11, 4.0)]


def _keyword_only(location, clock, **overrides):
    from kvmem.text import HashEmbedder, MemoryStore, TextStoreConfig

    # hybrid's first stage without the dense leg: exact ranks (the second stage has tests of its own)
    config = TextStoreConfig(**{"dense_weight": 0.0, "rerank": "none", **overrides})
    return MemoryStore(location, embedder=HashEmbedder(), config=config, clock=clock)


def test_hybrid_finds_the_reply_next_to_the_words(store_location, clock):
    with _keyword_only(store_location, clock, speaker_weight=0.0) as store:
        question, reply, other = store.add(
            "alice",
            messages=[
                {"role": "Bo", "content": "Do you still go running every morning?"},
                {"role": "Al", "content": "Yes, six miles before breakfast"},
                {"role": "Bo", "content": "Cool"},
            ],
            session_id="s1",
        )
        [elsewhere] = store.add(
            "alice", messages=[{"role": "Bo", "content": "Nice weather"}], session_id="s2"
        )
        assert [h.memory.id for h in store.search("alice", "running every morning", mode="keyword")] == [
            question.id
        ]
        hits = store.search("alice", "running every morning", top_k=10)
        # rrf(k=60): the question is keyword rank 1, the reply after it rank 2 with half its BM25 score;
        # "Cool" follows the reply, not the question, and "Nice weather" is another session
        assert [h.memory.id for h in hits] == [question.id, reply.id]
        assert [round(h.score, 6) for h in hits] == [1.0, round(61 / 62, 6)]
        assert other.id not in [h.memory.id for h in hits]
        store.delete("alice", question.id)  # a deleted turn lends its words to no one
        assert store.search("alice", "running every morning") == []
        assert elsewhere.id not in [h.memory.id for h in hits]


def test_hybrid_lifts_turns_of_the_named_speaker(store_location, clock):
    with _keyword_only(store_location, clock, neighbour_weight=0.0, speaker_weight=0.3) as store:
        ana, ben = store.add(
            "alice",
            messages=[
                {"role": "Ana", "content": "pizza"},
                {"role": "Ben Stone", "content": "I could eat pizza every single day of the week"},
            ],
        )
        assert [h.memory.id for h in store.search("alice", "pizza", mode="keyword")] == [ana.id, ben.id]
        assert [h.memory.id for h in store.search("alice", "pizza")] == [ana.id, ben.id]  # nobody named
        hits = store.search("alice", "What pizza does Ben like?")
        assert [h.memory.id for h in hits] == [ben.id, ana.id]
        assert [round(h.score, 6) for h in hits] == [
            round((61 / 62 + 0.3) / 1.3, 6),
            round(1 / 1.3, 6),
        ]


def test_neighbours_follow_appends_to_the_cached_rows(store_location, clock):
    with _keyword_only(store_location, clock, speaker_weight=0.0) as store:
        [question] = store.add(
            "alice", messages=[{"role": "Bo", "content": "Any plans for Lisbon?"}], session_id="s"
        )
        assert [h.memory.id for h in store.search("alice", "Lisbon")] == [question.id]  # rows now cached
        [reply] = store.add("alice", messages=[{"role": "Al", "content": "Yes, in May"}], session_id="s")
        [other] = store.add("alice", messages=[{"role": "Al", "content": "Yes, in May"}], session_id="t")
        assert [h.memory.id for h in store.search("alice", "Lisbon")] == [question.id, reply.id]
        assert other.id != reply.id


def test_keyword_ranking_ignores_other_users_rows(store):
    """BM25 statistics are the user's own: another user's writes change neither order nor scores."""
    apple, banana, plum = store.add("alice", texts=["apple tart", "banana bread", "banana plum jam"])
    store.add("alice", texts=["quiet evening", "long walk home"])

    def ranking(mode):
        return [(h.memory.id, h.score) for h in store.search("alice", "apple banana", top_k=10, mode=mode)]

    before = {mode: ranking(mode) for mode in ("keyword", "hybrid")}
    # within alice, apple is the rarer word, so the apple turn leads; bananas tie on idf, the shorter first
    assert [i for i, _ in before["keyword"]] == [apple.id, banana.id, plum.id]
    # bob makes apple the commoner word of the whole file (a file-wide idf would now put bananas first)
    bob = store.add("bob", texts=[f"apple number {i}" for i in range(30)])
    assert {mode: ranking(mode) for mode in before} == before
    store.delete("bob", bob[0].id)
    store.add("carol", texts=["banana"] * 3)
    assert {mode: ranking(mode) for mode in before} == before


def test_keyword_scores_are_bm25_over_the_users_rows(store):
    """The score by hand: N, df and the average length are alice's (5 rows, 13 words)."""
    import math

    a, b, _, _, _ = store.add(
        "alice", texts=["red fox", "red red fox jumps high", "blue whale", "green tree", "small cat"]
    )
    store.add("bob", texts=["red"] * 7)
    hits = store.search("alice", "red", mode="keyword")
    n, df, avgdl = 5, 2, 13 / 5
    idf = math.log((n - df + 0.5) / (df + 0.5))

    def bm25(tf, dl):
        return idf * tf * 2.2 / (tf + 1.2 * (0.25 + 0.75 * dl / avgdl))

    # the short turn wins: its one 'red' in 2 words outweighs two in 5
    assert [h.memory.id for h in hits] == [a.id, b.id]
    assert [h.score for h in hits] == [bm25(1, 2), bm25(2, 5)]


def test_dense_candidates_lean_on_their_neighbours():
    """cosine + w/2 * (cosine of the previous turn + of the next), within a session; exact scores."""
    import numpy as np

    from kvmem.text.search.vectors import UserVectors, top_k_by_dot

    basis = np.eye(3, dtype=np.float32)
    rows = UserVectors(
        gen=1,
        rowids=np.arange(10, 14, dtype=np.int64),
        matrix=np.stack([basis[0], basis[1], basis[2], basis[1]]),  # [4, 3]
        sessions=np.array(["a", "a", "a", "b"], dtype=object),
        speakers=np.array([""] * 4, dtype=object),
        lengths=np.ones(4, dtype=np.int64),
    )
    query = np.array([0.0, 1.0, 0.0], dtype=np.float32)
    # plain: the two rows equal to the query tie, lower rowid first; the others score 0
    assert top_k_by_dot(rows, query, 4) == [(11, 1.0), (13, 1.0), (10, 0.0), (12, 0.0)]
    # row 11 is the neighbour of 10 and 12 (session a); 13 is alone in session b
    assert top_k_by_dot(rows, query, 4, neighbour_weight=0.5) == [
        (11, 1.0),
        (13, 1.0),
        (10, 0.25),
        (12, 0.25),
    ]
    assert top_k_by_dot(rows, query, 2, np.array([10, 12]), neighbour_weight=0.5) == [(10, 0.25), (12, 0.25)]
