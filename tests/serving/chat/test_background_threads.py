"""The work after a turn (logging the reply) runs on the chat service's own bounded threads, not on the
default executor that prepares requests: a store that is slow to take the replies (a slow PostgreSQL) makes
that work queue, and chats go on being prepared and answered (issue 42 item 18)."""

from __future__ import annotations

import os
import threading

import pytest
from fastapi.testclient import TestClient

from serving.chat.service import BACKGROUND_THREADS
from tests.serving.conftest import ALICE, MODEL, Stack


def test_replies_held_by_a_slow_store_never_take_the_threads_that_prepare_chats(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: 1)  # the loop's default executor: min(32, 1 + 4) = 5 threads
    num_chats = 5 + 2  # more held replies than the default executor has threads
    release, timed_out = threading.Event(), threading.Event()
    lock = threading.Lock()
    running, most_at_once, logged = [0], [0], []
    chat = stack.app.state.chat
    store_reply = chat._store_reply

    def slow_store_reply(*args) -> None:  # the store takes each reply only once released
        with lock:
            running[0] += 1
            most_at_once[0] = max(most_at_once[0], running[0])
        if not release.wait(10):
            timed_out.set()
        with lock:
            running[0] -= 1
        store_reply(*args)
        logged.append(args[0].query)

    monkeypatch.setattr(chat, "_store_reply", slow_store_reply)
    with TestClient(stack.app) as client:
        for i in range(num_chats):
            body = {"model": MODEL, "messages": [{"role": "user", "content": f"question {'?' * (i + 1)}"}]}
            r = client.post("/v1/chat/completions", json=body, headers=ALICE)
            assert r.status_code == 200, r.text
        assert not timed_out.is_set()  # every chat was answered while the replies before it were held
        release.set()
        client.portal.call(chat.drain)
    assert most_at_once[0] == BACKGROUND_THREADS
    assert sorted(logged) == sorted(f"question {'?' * (i + 1)}" for i in range(num_chats))
    turns = stack.store.list_turns("alice", page_size=100).items
    assert len(turns) == 2 * num_chats  # each user turn and its reply
