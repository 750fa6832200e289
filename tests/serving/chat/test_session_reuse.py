"""Conversation KV reuse through the HTTP routes, the real scheduler and the transformers backend on the tiny
llama: a session's next turn starts from the cache its last turn left (X-Session-Id), with the same tokens as
without it; another user with the same session id and messages never gets it (invariant 4); deleting a memory
the cache carries drops it before the call returns (invariant 5); `session_kv_bytes=0` turns reuse off."""

from __future__ import annotations

import pytest

from kvmem.kv.inject import common_prefix_tokens
from tests.serving.kvstack import load_backend, served

MEMORIES = ["I live in Lisbon.", "My dog is called Miso.", "I play the violin on Tuesdays."]


def chat(s, user: str, messages: list[dict], session: str | None) -> dict:
    body = {"model": "default", "user": user, "messages": messages, "max_tokens": 6, "temperature": 0}
    headers = {"X-Session-Id": session} if session else {}
    r = s.client.post("/v1/chat/completions", json=body, headers=headers)
    assert r.status_code == 200, r.text
    return r.json()


def conversation(s, user: str, session: str | None, between=None) -> list[dict]:
    """Two turns (`between()` runs after the first); returns both responses."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Where do I live?"}]
    first = chat(s, user, messages, session)
    if between is not None:
        between()
    messages += [
        {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
        {"role": "user", "content": "And what is my dog called?"},
    ]
    return [first, chat(s, user, messages, session)]


def cached(response: dict) -> int:
    return response["usage"]["prompt_tokens_details"]["cached_tokens"]


def seeded(s, users=("alice", "bob")) -> dict[str, dict[str, str]]:
    ids = {u: {text: s.add(u, text) for text in MEMORIES} for u in users}
    s.plans.flush()
    for u in users:
        assert s.plan(u)["tier"] == "kv"
    return ids


def saved(tmp_path_factory, tokenizer, name: str, model):
    d = tmp_path_factory.mktemp(name)
    model.save_pretrained(d)
    tokenizer.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def sliding_model_dir(tmp_path_factory, tokenizer):
    """A tiny qwen2 whose second layer attends to a sliding window of 40 positions, saved as a model dir."""
    from tests.serving.engine.test_engine import tiny_sliding

    return saved(tmp_path_factory, tokenizer, "tiny-sliding", tiny_sliding("qwen2", len(tokenizer)))


@pytest.fixture(scope="module")
def capped_model_dir(tmp_path_factory, tokenizer):
    """A tiny Gemma 2 (attention logits soft-capped, sliding and full layers), saved as a model dir."""
    from tests.serving.engine.test_engine import tiny_capped

    return saved(tmp_path_factory, tokenizer, "tiny-capped", tiny_capped("gemma2", len(tokenizer)))


@pytest.mark.parametrize("model", ["tiny_model_dir", "sliding_model_dir", "capped_model_dir"])
def test_a_sessions_next_turn_starts_from_its_cache_with_the_same_tokens(tmp_path, request, model):
    """Also for a model with a sliding-window layer, and one whose attention soft-caps its logits (loaded with
    transformers' written-out attention, which applies the cap): each is served by the engine (its blocks and
    sessions are pages) and its window is shorter than the block."""
    with served(tmp_path, load_backend(request.getfixturevalue(model), tmp_path)) as s:
        assert s.backend.pool is not None
        if model == "capped_model_dir":
            assert s.backend.handle.model.config._attn_implementation == "eager"
        seeded(s, ["alice"])
        block_len = s.plan("alice")["tokens"]
        window = getattr(s.backend.handle.model.config.get_text_config(), "sliding_window", None)
        assert window is None or block_len > window
        # no session, and the prefix cache (tested in test_prefix_reuse.py) emptied before each turn: the block
        # item only
        forget = lambda: s.backend.pool.prefix.drop_user("alice")  # noqa: E731
        plain = conversation(s, "alice", None, forget)
        assert [cached(r) for r in plain] == [block_len, block_len]
        assert s.backend.sessions.keys() == []
        forget()
        kept = []
        first, second = conversation(
            s, "alice", "s1", lambda: kept.append(s.backend.sessions.peek("alice", "s1"))
        )
        assert cached(first) == block_len
        # the second turn reused the longest common prefix of its prompt with what the first turn left
        prompt2 = s.backend.sessions.peek("alice", "s1").ids[: second["usage"]["prompt_tokens"]]
        assert cached(second) == common_prefix_tokens(kept[0].ids, prompt2) > block_len
        assert kept[0].ids[: cached(second)] == prompt2[: cached(second)]
        # same ids, same tokens: the reused turn answers as the turn without a session did
        assert [r["choices"][0]["message"]["content"] for r in (first, second)] == [
            r["choices"][0]["message"]["content"] for r in plain
        ]
        assert plain[1]["usage"]["prompt_tokens"] == second["usage"]["prompt_tokens"]
        assert s.backend.sessions.stats.hits == 1


def test_another_user_with_the_same_session_and_messages_never_reuses_it(tmp_path, tiny_model_dir):
    with served(tmp_path, load_backend(tiny_model_dir, tmp_path)) as s:
        seeded(s)
        alice = conversation(s, "alice", "s1")
        entry = s.backend.sessions.peek("alice", "s1")
        bob_first = chat(
            s, "bob", [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], "s1"
        )
        assert cached(bob_first) == s.plan("bob")["tokens"]  # his own block, nothing of alice's session
        assert s.backend.sessions.peek("alice", "s1") is entry  # alice's entry untouched
        assert sorted(s.backend.sessions.keys()) == [("alice", "s1"), ("bob", "s1")]
        assert s.backend.sessions.peek("bob", "s1").user_id == "bob"
        assert cached(alice[1]) > s.plan("alice")["tokens"]


def test_deleting_a_memory_the_cache_carries_drops_it_before_the_call_returns(tmp_path, tiny_model_dir):
    with served(tmp_path, load_backend(tiny_model_dir, tmp_path)) as s:
        ids = seeded(s)
        conversation(s, "alice", "s1")
        conversation(s, "alice", "s2")
        conversation(s, "bob", "s1")
        assert sorted(s.backend.sessions.keys()) == [("alice", "s1"), ("alice", "s2"), ("bob", "s1")]
        r = s.client.delete(f"/v1/memories/{ids['alice'][MEMORIES[1]]}", params={"user_id": "alice"})
        assert r.status_code == 200, r.text
        assert s.backend.sessions.keys() == [("bob", "s1")]
        s.plans.flush()
        first, second = conversation(s, "alice", "s1")  # cold again, over the rebuilt block
        assert cached(first) == s.plan("alice")["tokens"] and cached(second) > cached(first)
        r = s.client.delete("/v1/memories", params={"user_id": "bob"})
        assert r.status_code == 200 and s.backend.sessions.keys() == [("alice", "s1")]


def test_reuse_off(tmp_path, tiny_model_dir):
    with served(tmp_path, load_backend(tiny_model_dir, tmp_path, session_kv_bytes=0)) as s:
        seeded(s, ["alice"])
        first, second = conversation(s, "alice", "s1")
        assert cached(first) == cached(second) == s.plan("alice")["tokens"]
        assert s.backend.sessions.keys() == [] and s.backend.sessions.stats.hits == 0
