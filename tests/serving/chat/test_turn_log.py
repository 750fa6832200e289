"""The chat turn in the conversation log (issue 42): the user's turn is committed before the answer is
acknowledged (item 19); a deleted session's turns in flight are never logged (item 10); a memory's delete
takes the replies that repeat it (item 27). Over the fake backend and the server's own store and formation."""

from __future__ import annotations

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
