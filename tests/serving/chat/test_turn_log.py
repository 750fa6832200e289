"""The chat turn in the conversation log (issue 42): the user's turn is committed before the answer is
acknowledged (item 19); a deleted session's turns in flight are never logged (item 10); a memory's delete
takes the replies that repeat it (item 27). Over the fake backend and the server's own store and formation."""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterator
from typing import Any

import httpx
from fastapi.testclient import TestClient

from tests.serving.conftest import ALICE, MODEL, Stack, live_server, make_stack, wait_for


def _chat(content: str, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "user": "alice", **extra}


def _log(stack: Stack) -> list[tuple[str, str]]:
    """alice's log, oldest first, as (role, text)."""
    return [(t.role, t.text) for t in reversed(stack.store.list_turns("alice", page_size=100).items)]


def test_the_users_turn_is_logged_before_the_first_byte_of_a_stream(tmp_path) -> None:
    """The backend produces one token, then holds: when the client reads the stream's first line, the user's
    turn is already committed (it used to be logged in the background after the whole reply); the reply
    follows once the stream ends, as the answer to that turn."""
    stack = make_stack(tmp_path)
    backend = stack.backend

    def reply(req: Any) -> Iterator[str]:
        yield "H"
        backend.hold.set()  # the rest waits until the test has read the first byte
        yield from "ello."

    backend.reply = reply
    try:
        with live_server(stack.app) as url:
            body = _chat("My cat is called Pixel.", stream=True)
            with httpx.stream(
                "POST", f"{url}/v1/chat/completions", json=body, headers=ALICE, timeout=30
            ) as r:
                lines = r.iter_lines()
                first = next(line for line in lines if line)
                assert first.startswith("data: ") and '"role": "assistant"' in first
                assert _log(stack) == [("user", "My cat is called Pixel.")]
                backend.hold.clear()
                rest = [line for line in lines if line]
            assert rest[-1] == "data: [DONE]"
            wait_for(lambda: not stack.app.state.chat._background, "the reply to be logged")
            assert _log(stack) == [("user", "My cat is called Pixel."), ("assistant", "Hello.")]
    finally:
        backend.hold.clear()
        stack.scheduler.stop()


def test_the_users_turn_is_logged_before_a_non_streamed_answer(tmp_path) -> None:
    """The reply's logging is held back: the answer is returned with the user's turn already in the log."""
    stack = make_stack(tmp_path)
    log_turns, release = stack.store.log_turns, threading.Event()

    def held(user_id: str, messages: list[dict], **kwargs: Any) -> Any:
        if any(m["role"] == "assistant" for m in messages):
            assert release.wait(30)
        return log_turns(user_id, messages, **kwargs)

    stack.store.log_turns = held
    try:
        with TestClient(stack.app) as client:
            r = client.post("/v1/chat/completions", json=_chat("I live in Oslo."), headers=ALICE)
            assert r.status_code == 200
            assert _log(stack) == [("user", "I live in Oslo.")]
            release.set()
            client.portal.call(client.app.state.chat.drain)
            assert _log(stack) == [("user", "I live in Oslo."), ("assistant", "Hello from kvmem.")]
    finally:
        release.set()
        stack.scheduler.stop()


def test_a_chat_in_flight_in_a_deleted_session_is_never_logged_nor_formed(tmp_path) -> None:
    """Item 10: the chat in session s1 is admitted and held in the backend; DELETE /v1/memories?session_id=s1
    returns; the chat then completes: neither its turn nor its reply is logged, and nothing is formed. The
    same chat in session s2 is logged and formed as before."""
    stack = make_stack(tmp_path)
    chat = stack.app.state.chat
    try:
        with live_server(stack.app) as url:
            stack.backend.hold.set()
            answers: list[int] = []
            body = _chat("My cat is called Pixel.")
            held = threading.Thread(
                target=lambda: answers.append(
                    httpx.post(
                        f"{url}/v1/chat/completions",
                        json=body,
                        headers={**ALICE, "X-Session-Id": "s1"},
                        timeout=30,
                    ).status_code
                )
            )
            held.start()
            try:
                wait_for(lambda: stack.backend.num_in_flight == 1, "the chat to be admitted and held")
                params = {"user_id": "alice", "session_id": "s1"}
                deleted = httpx.delete(f"{url}/v1/memories", params=params, headers=ALICE)
                assert deleted.json() == {"deleted": 0}
            finally:
                stack.backend.hold.clear()
                held.join(timeout=30)
            assert answers == [200]
            wait_for(lambda: not chat._background, "the held chat's reply to be handled")
            assert stack.app.state.formation.wait_idle(20)
            assert _log(stack) == [] and stack.store.list("alice").total == 0
            headers = {**ALICE, "X-Session-Id": "s2"}
            assert httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers).status_code == 200
            wait_for(lambda: not chat._background, "the next reply to be logged")
            wait_for(lambda: stack.store.list("alice").total == 1, "the next turn to be formed")
            assert _log(stack) == [("user", "My cat is called Pixel."), ("assistant", "Hello from kvmem.")]
    finally:
        stack.backend.hold.clear()
        stack.scheduler.stop()


def test_a_deleted_memory_takes_its_echo_and_the_replies_that_used_it(tmp_path) -> None:
    """Item 27: a formed memory's source turn was echoed by the bot, and later answers used the memory: the
    delete removes the source turn and all those replies from GET /v1/memories/turns before it returns; the
    user's other turns stay (a reply that used other memories only stays too: tests/kvmem/text/test_log.py)."""
    stack = make_stack(tmp_path)
    stack.backend.reply = "Noted: peanuts."
    try:
        with TestClient(stack.app) as client:
            client.post("/v1/chat/completions", json=_chat("I am allergic to peanuts."), headers=ALICE)
            client.portal.call(client.app.state.chat.drain)
            assert client.app.state.formation.wait_idle(20)
            [allergy] = stack.store.list("alice").items
            stack.backend.reply = "Anything without peanuts."
            r = client.post("/v1/chat/completions", json=_chat("What can I eat? peanuts"), headers=ALICE)
            assert {"id": allergy.id, "tier": "text"} in r.json()["memory"]["used"]
            stack.backend.reply = "Hello."
            r = client.post("/v1/chat/completions", json=_chat("Hi there"), headers=ALICE)
            assert r.json()["memory"]["used"] == [{"id": allergy.id, "tier": "text"}]  # all she has
            client.portal.call(client.app.state.chat.drain)
            assert client.app.state.formation.wait_idle(20)
            r = client.delete(f"/v1/memories/{allergy.id}", params={"user_id": "alice"}, headers=ALICE)
            assert r.json() == {"deleted": 1}
            listed = client.get("/v1/memories/turns", params={"user_id": "alice"}, headers=ALICE).json()
            assert [(t["role"], t["text"]) for t in reversed(listed["data"])] == [
                ("user", "What can I eat? peanuts"),
                ("user", "Hi there"),
            ]
    finally:
        stack.scheduler.stop()


def test_a_store_that_takes_no_writes_still_answers_the_chat(tmp_path) -> None:
    """The degraded mode docs/API.md promises (a full disk, the store's server away): the chat is answered,
    its turn is not in the log, and the log line names the failure, not the user's words."""
    stack = make_stack(tmp_path)

    def full(*args: Any, **kwargs: Any) -> Any:
        raise sqlite3.OperationalError("database or disk is full")

    stack.store.log_turns = full
    try:
        with TestClient(stack.app) as client:
            r = client.post("/v1/chat/completions", json=_chat("My PIN is 4711."), headers=ALICE)
            assert r.status_code == 200
            assert r.json()["choices"][0]["message"]["content"] == "Hello from kvmem."
            client.portal.call(client.app.state.chat.drain)
            assert _log(stack) == []
    finally:
        stack.scheduler.stop()
