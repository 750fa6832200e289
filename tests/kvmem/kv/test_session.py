"""Live sessions' KV caches (kvmem/kv/session.py): a reused turn gives the same greedy tokens as a cold full
prefill of the same ids (invariant 1) and never writes the stored block item (invariant 2); entries are per
user and session (invariant 4), bounded, and dropped by the delete cascade (invariant 5)."""

from __future__ import annotations

import hashlib

import pytest
import torch
from transformers import DynamicCache

from benchmarks.ttft_grid import reference_tokens
from kvmem.kv import GenerationStats, PromptLayout, Sampling, build_item, generate, inject
from kvmem.kv.inject import common_prefix_tokens
from kvmem.kv.session import SessionCache
from tests.conftest import synthetic_memories

TURNS = [
    ("Hello! I just got back from a long hike in the hills.", ["I like tea.", "I swim on Sundays."]),
    ("Which city did I say I wanted to visit next spring?", ["I want to visit Kyoto."]),
    ("Remind me what my dog is called, please.", []),
    ("And what should I cook tonight?", ["I bake sourdough.", "I am allergic to peanuts.", "I like figs."]),
]


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def converse(handle, sessions: SessionCache, *, user="alice", session="s1", block_tokens=300, max_new=12):
    """Four turns of one conversation through the session cache, as the backend runs them. Returns, per turn,
    (prompt ids, tokens, stats, the common prefix with the previous turn's cache) and the block item."""
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
        lease = sessions.take(
            user, session, item.item_id, [*mids, *(f"t{k}.{j}" for j in range(len(retrieved)))]
        )
        prefix = sessions.start(lease, prompt.ids, inject(item, prompt.ids))
        stats = GenerationStats()
        sampling = Sampling(max_new_tokens=max_new)
        tokens = list(generate(handle.model, prompt.ids, prefix=prefix, sampling=sampling, stats=stats))
        fed = (*prompt.ids, *tokens)[: prefix.cache.get_seq_length()]
        assert len(fed) == len(prompt.ids) + len(tokens) - 1
        assert sessions.put(lease, fed, prefix.cache)
        out.append((prompt.ids, tokens, stats, stable, fed))
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
    sessions = SessionCache(1 << 30)
    turns, block_len = converse(tiny_handle, sessions, max_new=12)
    _check(tiny_handle, turns, block_len, 12)
    assert sessions.stats.hits == 3 and sessions.keys() == [("alice", "s1")]


@pytest.mark.slow
def test_reused_turns_are_token_identical_to_a_cold_prefill_real(default_handle):
    sessions = SessionCache(1 << 30)
    turns, block_len = converse(default_handle, sessions, block_tokens=1500, max_new=24)
    _check(default_handle, turns, block_len, 24)


# -- bounds, isolation and the delete cascade (real caches from the tiny model) ----------------------------------
def _cache(handle, ids: list[int]) -> DynamicCache:
    cache = DynamicCache()
    with torch.inference_mode():
        handle.model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True)
    return cache


def _keep(sessions, handle, user, session, ids, block=None, memories=()):
    lease = sessions.take(user, session, block, memories)
    return sessions.put(lease, ids, _cache(handle, ids))


def test_another_user_never_gets_the_entry(tiny_handle):
    sessions = SessionCache(1 << 30)
    ids = list(range(10, 60))
    assert _keep(sessions, tiny_handle, "alice", "s1", ids)
    bob = sessions.take("bob", "s1", None, [])
    assert bob.entry is None
    start = sessions.start(bob, ids + [7], None)
    assert start.reused_tokens == 0 and start.cache.get_seq_length() == 0
    sessions.release(bob)
    alice = sessions.take("alice", "s1", None, [])
    assert alice.entry is not None and sessions.start(alice, ids + [7], None).reused_tokens == 50
    sessions.put(alice, ids, alice.entry.cache)
    adapted = sessions.take("alice", "s1", None, [], variant="adapter-1@v2")  # other K/V: not reused
    assert adapted.entry is None and sessions.keys() == []


def test_start_uses_the_longest_common_prefix_and_leaves_a_token_to_prefill(tiny_handle):
    sessions = SessionCache(1 << 30)
    ids = list(range(10, 60))
    _keep(sessions, tiny_handle, "alice", "s1", ids)
    lease = sessions.take("alice", "s1", None, [])
    start = sessions.start(lease, ids[:30] + [99, 98], None)
    assert start.reused_tokens == 30 and start.cache.get_seq_length() == 30
    assert lease.entry.cache.get_seq_length() == 50  # the entry's own tensors are views, not cut
    same = sessions.start(lease, ids, None)
    assert same.reused_tokens == 49  # the whole prompt is cached: its last token is prefilled again


def test_bounds_per_user_and_in_bytes_least_recent_first(tiny_handle):
    one = SessionCache(1 << 30)
    _keep(one, tiny_handle, "alice", "a", list(range(10, 30)))
    per_entry = one.nbytes
    sessions = SessionCache(3 * per_entry, max_per_user=2)
    for user, session in [("alice", "a"), ("alice", "b"), ("bob", "x")]:
        assert _keep(sessions, tiny_handle, user, session, list(range(10, 30)))
    assert _keep(sessions, tiny_handle, "alice", "c", list(range(10, 30)))  # alice's oldest goes
    assert sessions.keys() == [("alice", "b"), ("bob", "x"), ("alice", "c")]
    assert _keep(sessions, tiny_handle, "carol", "y", list(range(10, 30)))  # over the bytes: the oldest goes
    assert sessions.keys() == [("bob", "x"), ("alice", "c"), ("carol", "y")]
    assert sessions.nbytes == 3 * per_entry
    assert not _keep(sessions, tiny_handle, "dave", "z", list(range(10, 80)))  # bigger than the whole budget
    assert ("dave", "z") not in sessions.keys()
    assert not SessionCache(0).enabled


def test_forget_drops_what_carries_the_memory_and_stops_running_requests_putting_it_back(tiny_handle):
    sessions = SessionCache(1 << 30)
    ids = list(range(10, 40))
    _keep(sessions, tiny_handle, "alice", "s1", ids, block="item-1", memories=["m1", "m2"])
    _keep(sessions, tiny_handle, "alice", "s2", ids, block="item-2", memories=["m3"])
    _keep(sessions, tiny_handle, "bob", "s1", ids, block="item-3", memories=["m1"])  # ids are per user
    running = sessions.take("alice", "s3", "item-5", ["m2"])
    other = sessions.take("alice", "s4", "item-4", ["m5"])
    assert sessions.forget("alice", ["m9"]) == []
    assert sessions.forget("alice", ["m2"]) == [("alice", "s1")]
    assert not sessions.put(running, ids, _cache(tiny_handle, ids))  # it was running with m2
    assert sessions.put(other, ids, _cache(tiny_handle, ids))
    assert sessions.keys() == [("alice", "s2"), ("bob", "s1"), ("alice", "s4")]
    assert sessions.drop_block("item-2") == [("alice", "s2")]
    assert sessions.forget("alice") == [("alice", "s4")]
    assert sessions.keys() == [("bob", "s1")]


def test_a_cache_that_does_not_hold_the_ids_is_not_kept(tiny_handle):
    sessions = SessionCache(1 << 30)
    lease = sessions.take("alice", "s1", None, [])
    assert not sessions.put(lease, list(range(10, 20)), _cache(tiny_handle, list(range(10, 21))))
    assert sessions.keys() == []
