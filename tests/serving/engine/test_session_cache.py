"""Live sessions' KV caches (serving/engine/sessions.py) over the engine's pages: a reused turn gives the same greedy
tokens as a cold full prefill of the same ids (invariant 1) and never writes the stored block item (invariant
2); entries are per user and session (invariant 4), bounded, and dropped by the delete cascade (invariant 5),
their pages going back to the pool. The server's own sessions: tests/serving/chat/test_session_reuse.py."""

from __future__ import annotations

import hashlib

import pytest
import torch

from benchmarks.ttft.ttft_grid import reference_tokens
from kvmem.kv import PromptLayout, Sampling, build_item
from kvmem.kv.inject import common_prefix_tokens
from serving.engine.sessions import SessionCache
from serving.engine.table import PageTable
from tests.conftest import synthetic_memories
from tests.serving.engine.test_engine import make_pool
from tests.serving.engine.test_session_pages import in_use, turn

TURNS = [
    ("Hello! I just got back from a long hike in the hills.", ["I like tea.", "I swim on Sundays."]),
    ("Which city did I say I wanted to visit next spring?", ["I want to visit Kyoto."]),
    ("Remind me what my dog is called, please.", []),
    ("And what should I cook tonight?", ["I bake sourdough.", "I am allergic to peanuts.", "I like figs."]),
]


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def converse(
    handle, sessions: SessionCache, pool, *, user="alice", session="s1", block_tokens=300, max_new=12
):
    """Four turns of one conversation through the session cache and the engine, as the backend runs them.
    Returns, per turn, (prompt ids, tokens, stats, the ids of the history before its user message, the ids
    its cache kept) and the block's length."""
    layout = PromptLayout(handle.tokenizer)
    memories = synthetic_memories(block_tokens, handle.tokenizer, seed=7)
    block_ids = layout.block_ids(memories)
    mids = [f"m{i}" for i in range(len(memories))]
    item = build_item(handle, block_ids, user_id=user, memory_ids=mids)
    messages = [{"role": "system", "content": "Answer briefly."}]
    out, before = [], _digest(item.kv)
    gen_len = len(handle.tokenizer("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"])
    for k, (query, retrieved) in enumerate(TURNS):
        # the ids of the history before this turn's user message: stable from here on
        stable = len(layout.prompt(memories, [], messages, block_ids=block_ids).ids) - gen_len
        messages.append({"role": "user", "content": query})
        prompt = layout.prompt(memories, retrieved, messages, block_ids=block_ids)
        memory_ids = (*mids, *(f"t{k}.{j}" for j in range(len(retrieved))))
        sampling = Sampling(max_new_tokens=max_new)
        seq, _, _ = turn(handle.model, pool, sessions, prompt.ids, item, user, session, memory_ids, sampling)
        tokens, fed = seq.stats.token_ids, sessions.peek(user, session).ids
        assert len(fed) == len(prompt.ids) + len(tokens) - 1
        out.append((prompt.ids, tokens, seq.stats, stable, fed))
        messages.append(
            {"role": "assistant", "content": handle.tokenizer.decode(tokens, skip_special_tokens=True)}
        )
    assert _digest(item.kv) == before, "the stored block item was written"
    return out, len(block_ids)


def _check(handle, turns, block_len, max_new):
    for k, (ids, tokens, stats, _stable, _fed) in enumerate(turns):
        assert tokens == reference_tokens(handle.model, list(ids), max_new, "cpu"), f"turn {k + 1}"
        if k == 0:
            assert stats.reused_tokens == block_len  # the block item, nothing else yet
        else:  # block, client system and the history before the previous user message: from the session
            _, _, _, stable, fed = turns[k - 1]
            assert stats.reused_tokens == common_prefix_tokens(fed, ids)
            assert stats.reused_tokens >= stable > block_len
        assert stats.prefilled_tokens == len(ids) - stats.reused_tokens


def test_reused_turns_are_token_identical_to_a_cold_prefill_tiny(tiny_handle):
    sessions, pool = SessionCache(1 << 30), make_pool(tiny_handle.model)
    turns, block_len = converse(tiny_handle, sessions, pool, max_new=12)
    _check(tiny_handle, turns, block_len, 12)
    assert sessions.stats.hits == 3 and sessions.keys() == [("alice", "s1")]
    assert pool.used_pages == len(in_use(pool, sessions))


@pytest.mark.slow
def test_reused_turns_are_token_identical_to_a_cold_prefill_real(default_handle):
    sessions, pool = SessionCache(1 << 30), make_pool(default_handle.model, mb=512)
    turns, block_len = converse(default_handle, sessions, pool, block_tokens=1500, max_new=24)
    _check(default_handle, turns, block_len, 24)


# -- bounds, isolation and the delete cascade (page tables of the tiny model's pool) -------------------------------
def _table(pool, n: int) -> PageTable:
    """A table holding n positions (their K/V not written: the bookkeeping is what is tested here)."""
    table = PageTable.admit(pool, n)
    table.extend(n, torch.device("cpu"))
    return table.keep(n)


def _keep(sessions, pool, user, session, ids, block=None, memories=()):
    lease = sessions.take(user, session, block, memories)
    return sessions.put(lease, ids, _table(pool, len(ids)))


def test_another_user_never_gets_the_entry(tiny_handle):
    sessions, pool = SessionCache(1 << 30), make_pool(tiny_handle.model)
    ids = list(range(10, 60))
    assert _keep(sessions, pool, "alice", "s1", ids)
    bob = sessions.take("bob", "s1", None, [])
    assert bob.entry is None and sessions.reuse(bob, ids + [7], 0) == 0
    sessions.release(bob)
    alice = sessions.take("alice", "s1", None, [])
    assert alice.entry is not None and sessions.reuse(alice, ids + [7], 0) == 50
    sessions.put(alice, ids, alice.entry.cache)
    adapted = sessions.take("alice", "s1", None, [], variant="adapter-1@v2")  # other K/V: not reused
    assert adapted.entry is None and sessions.keys() == []
    assert pool.used_pages == 0  # the dropped entry's pages went back


def test_reuse_is_the_longest_common_prefix_and_leaves_a_token_to_prefill(tiny_handle):
    sessions, pool = SessionCache(1 << 30), make_pool(tiny_handle.model)
    ids = list(range(10, 60))
    _keep(sessions, pool, "alice", "s1", ids)
    lease = sessions.take("alice", "s1", None, [])
    assert sessions.reuse(lease, ids[:30] + [99, 98], 0) == 30
    assert sessions.reuse(lease, ids[:30] + [99, 98], 31) == 0  # the block covers more
    assert lease.entry.cache.get_seq_length() == 50  # the entry is referenced, not cut
    assert (
        sessions.reuse(lease, ids, 0) == 49
    )  # the whole prompt is cached: its last token is prefilled again


def test_bounds_per_user_and_in_bytes_least_recent_first(tiny_handle):
    pool = make_pool(tiny_handle.model)
    one = SessionCache(1 << 30)
    _keep(one, pool, "alice", "a", list(range(10, 30)))
    per_entry = one.nbytes
    sessions = SessionCache(3 * per_entry, max_per_user=2)
    for user, session in [("alice", "a"), ("alice", "b"), ("bob", "x")]:
        assert _keep(sessions, pool, user, session, list(range(10, 30)))
    assert _keep(sessions, pool, "alice", "c", list(range(10, 30)))  # alice's oldest goes
    assert sessions.keys() == [("alice", "b"), ("bob", "x"), ("alice", "c")]
    assert _keep(sessions, pool, "carol", "y", list(range(10, 30)))  # over the bytes: the oldest goes
    assert sessions.keys() == [("bob", "x"), ("alice", "c"), ("carol", "y")]
    assert sessions.nbytes == 3 * per_entry
    assert not _keep(sessions, pool, "dave", "z", list(range(10, 120)))  # bigger than the whole budget
    assert ("dave", "z") not in sessions.keys()
    assert pool.used_pages == len(in_use(pool, sessions) | set(one.peek("alice", "a").cache.pages))
    assert not SessionCache(0).enabled


def test_forget_drops_what_carries_the_memory_and_stops_running_requests_putting_it_back(tiny_handle):
    sessions, pool = SessionCache(1 << 30), make_pool(tiny_handle.model)
    ids = list(range(10, 40))
    _keep(sessions, pool, "alice", "s1", ids, block="item-1", memories=["m1", "m2"])
    _keep(sessions, pool, "alice", "s2", ids, block="item-2", memories=["m3"])
    _keep(sessions, pool, "bob", "s1", ids, block="item-3", memories=["m1"])  # ids are per user
    running = sessions.take("alice", "s3", "item-5", ["m2"])
    other = sessions.take("alice", "s4", "item-4", ["m5"])
    assert sessions.forget("alice", ["m9"]) == []
    assert sessions.forget("alice", ["m2"]) == [("alice", "s1")]
    assert not sessions.put(running, ids, _table(pool, len(ids)))  # it was running with m2
    assert sessions.put(other, ids, _table(pool, len(ids)))
    assert sessions.keys() == [("alice", "s2"), ("bob", "s1"), ("alice", "s4")]
    assert sessions.drop_block("item-2") == [("alice", "s2")]
    assert sessions.forget("alice") == [("alice", "s4")]
    assert sessions.keys() == [("bob", "s1")]
    assert pool.used_pages == len(
        in_use(pool, sessions)
    )  # every dropped or refused table gave its pages back


def test_a_cache_that_does_not_hold_the_ids_is_not_kept(tiny_handle):
    sessions, pool = SessionCache(1 << 30), make_pool(tiny_handle.model)
    lease = sessions.take("alice", "s1", None, [])
    assert not sessions.put(lease, list(range(10, 20)), _table(pool, 11))
    assert sessions.keys() == [] and pool.used_pages == 0
