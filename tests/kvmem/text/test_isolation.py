"""Isolation: under random interleaved operations by many users, no call returns another user's memory,
and each user's store matches a simple model of what that user did."""

from __future__ import annotations

import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmem.text import HashEmbedder, MemoryNotFound, MemoryStore

USERS = [f"user{i}" for i in range(6)]
WORDS = ["apple", "pear", "plum", "fig", "kiwi", "lime"]

op = st.one_of(
    st.tuples(
        st.just("add"),
        st.sampled_from(USERS),
        st.lists(st.sampled_from(WORDS), min_size=1, max_size=3),
        st.sampled_from(["s1", "s2"]),
    ),
    st.tuples(st.just("update"), st.sampled_from(USERS), st.integers(0, 1000), st.sampled_from(WORDS)),
    st.tuples(st.just("delete"), st.sampled_from(USERS), st.integers(0, 1000)),
    st.tuples(st.just("delete_session"), st.sampled_from(USERS), st.sampled_from(["s1", "s2"])),
    st.tuples(st.just("probe"), st.sampled_from(USERS), st.integers(0, 1000)),
    st.tuples(
        st.just("search"),
        st.sampled_from(USERS),
        st.sampled_from(WORDS),
        st.sampled_from(["keyword", "dense", "hybrid"]),
    ),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(op, min_size=1, max_size=40))
def test_random_interleaved_operations_stay_isolated(ops):
    with (
        tempfile.TemporaryDirectory() as tmp,
        MemoryStore(Path(tmp) / "m.db", embedder=HashEmbedder()) as store,
    ):
        model: dict[str, dict[str, tuple[str, str]]] = {u: {} for u in USERS}  # user -> id -> (text, session)
        all_ids: list[tuple[str, str]] = []  # (owner, id), every id ever created
        for kind, user, *args in ops:
            if kind == "add":
                words, session = args
                [m] = store.add(user, " ".join(words), session_id=session)
                assert m.user_id == user
                model[user][m.id] = (m.text, session)
                all_ids.append((user, m.id))
            elif kind == "update" and all_ids:
                owner, memory_id = all_ids[args[0] % len(all_ids)]
                if owner == user and memory_id in model[user]:
                    assert store.update(user, memory_id, text=args[1]).text == args[1]
                    model[user][memory_id] = (args[1], model[user][memory_id][1])
                else:
                    try:
                        store.update(user, memory_id, text=args[1])
                        raise AssertionError("updated a memory that is not the caller's")
                    except MemoryNotFound:
                        pass
            elif kind == "delete" and all_ids:
                owner, memory_id = all_ids[args[0] % len(all_ids)]
                expected = 1 if owner == user and memory_id in model[user] else 0
                assert store.delete(user, memory_id) == expected
                if expected:
                    del model[user][memory_id]
            elif kind == "delete_session":
                doomed = [i for i, (_, s) in model[user].items() if s == args[0]]
                assert store.delete_session(user, args[0]) == len(doomed)
                for memory_id in doomed:
                    del model[user][memory_id]
            elif kind == "probe" and all_ids:
                owner, memory_id = all_ids[args[0] % len(all_ids)]
                if owner == user and memory_id in model[user]:
                    assert store.get(user, memory_id).text == model[user][memory_id][0]
                else:
                    try:
                        store.get(user, memory_id)
                        raise AssertionError("got a memory that is not the caller's")
                    except MemoryNotFound:
                        pass
                assert [m.id for m in store.memories_by_ids(user, [i for _, i in all_ids])] == [
                    i for _, i in all_ids if i in model[user]
                ]
            elif kind == "search":
                hits = store.search(user, args[0], top_k=50, mode=args[1])
                assert {h.memory.id for h in hits} <= set(model[user])
                if args[1] == "dense":
                    assert {h.memory.id for h in hits} == set(model[user])
                if args[1] == "keyword":
                    assert {h.memory.id for h in hits} == {
                        i for i, (t, _) in model[user].items() if args[0] in t.split()
                    }
        for user in USERS:
            page = store.list(user, page_size=1000)
            assert {m.id for m in page.items} == set(model[user]) and page.total == len(model[user])
            assert all(m.user_id == user for m in page.items)
            assert store.count(user) == len(model[user])
