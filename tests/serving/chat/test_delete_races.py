"""Deletes racing chat requests (issue 27 item 5), over the fake backend and the server's own scheduler, made
deterministic with the backend's hold gate and a hook inside the store's search: (a) a turn in flight during a
delete-all is not logged after the delete returned; (c) a request prepared before a delete never serves the
deleted text, neither as retrieved text nor as the prefill of the block the cascade dropped."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from serving.backends.fake import FakeBackend
from tests.serving.conftest import ALICE, MODEL, Stack, live_server, make_stack, wait_for

DOG, CITY, TEA = "My dog is called Miso.", "I live in Lisbon.", "I drink green tea."


def _chat(content: str = "what is my dog called?") -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "user": "alice"}


def _prompt(stack: Stack) -> str:
    return FakeBackend.decode(stack.backend.requests[-1].prompt.ids)


def _search_then(stack: Stack, after: Callable[[int], None]) -> list[int]:
    """Make the store's search call `after(call number)` once it has its hits, before they are returned: a
    change lands between the request's search and its layout. Returns the calls' log."""
    search, calls = stack.store.search, []

    def hooked(*args: Any, **kwargs: Any) -> Any:
        hits = search(*args, **kwargs)
        calls.append(len(calls))
        after(calls[-1])
        return hits

    stack.store.search = hooked
    return calls


def test_a_turn_in_flight_during_a_delete_all_is_not_logged_after_it(tmp_path) -> None:
    """5a: the chat is admitted and held in the backend; DELETE /v1/memories?user_id=alice returns; the chat
    then completes and its turn is not logged. A chat admitted after the delete logs its turn as before."""
    stack = make_stack(tmp_path)
    chat = stack.app.state.chat
    try:
        with live_server(stack.app) as url:
            assert (
                httpx.post(f"{url}/v1/chat/completions", json=_chat("hi"), headers=ALICE).status_code == 200
            )
            wait_for(lambda: not chat._background, "the first turn to be logged")
            assert stack.store.list_turns("alice").total == 2
            stack.backend.hold.set()
            answers: list[int] = []
            held = threading.Thread(
                target=lambda: answers.append(
                    httpx.post(
                        f"{url}/v1/chat/completions", json=_chat(), headers=ALICE, timeout=30
                    ).status_code
                )
            )
            held.start()
            try:
                wait_for(lambda: stack.backend.num_in_flight == 1, "the chat to be admitted and held")
                deleted = httpx.delete(f"{url}/v1/memories", params={"user_id": "alice"}, headers=ALICE)
                assert deleted.status_code == 200
                assert stack.store.list_turns("alice").total == 0
            finally:
                stack.backend.hold.clear()
                held.join(timeout=30)
            assert answers == [200]
            wait_for(lambda: not chat._background, "the held chat's turn to be handled")
            assert stack.store.list_turns("alice").total == 0  # was 2: the held turn, logged after the delete
            assert (
                httpx.post(f"{url}/v1/chat/completions", json=_chat("again"), headers=ALICE).status_code
                == 200
            )
            wait_for(lambda: not chat._background, "the next turn to be logged")
            assert [t.text for t in stack.store.list_turns("alice").items] == ["Hello from kvmem.", "again"]
    finally:
        stack.scheduler.stop()


@pytest.fixture
def client_stack(tmp_path):
    stack = make_stack(tmp_path, store_turns=False)
    with TestClient(stack.app) as client:
        yield client, stack
    stack.scheduler.stop()


def test_a_block_memory_deleted_while_the_request_is_prepared_is_not_served(client_stack) -> None:
    """5c: the block holding the dog was read from the plan, then the dog is deleted (the cascade drops the
    block) before the prompt is laid out. The request used to carry the dropped block's item: the backend fell
    back to prefilling the block's tokens, the deleted text. It is prepared again, without the dog."""
    client, stack = client_stack
    dog, city = (stack.store.add("alice", t)[0].id for t in (DOG, CITY))
    stack.scheduler.get("alice")
    stack.scheduler.flush()
    block = stack.scheduler.get("alice").block
    assert set(block.memory_ids) == {dog, city}
    calls = _search_then(stack, lambda n: n == 0 and stack.store.delete("alice", dog))
    reply = client.post("/v1/chat/completions", json=_chat(), headers=ALICE).json()
    assert calls == [0, 1]  # prepared twice
    assert "Miso" not in _prompt(stack) and CITY in _prompt(stack)
    assert reply["memory"]["used"] == [{"id": city, "tier": "text"}]
    assert stack.backend.requests[-1].block_item_id is None
    assert stack.backend.outcomes[-1].how == "completed" and len(stack.backend.requests) == 1


def test_a_retrieved_memory_deleted_while_the_request_is_prepared_is_not_served(client_stack) -> None:
    """5c, the text tier: the search found the dog (no block yet), the dog is deleted before the layout; the
    request is prepared again and carries only what is still stored."""
    client, stack = client_stack
    dog, city = (stack.store.add("alice", t)[0].id for t in (DOG, CITY))
    calls = _search_then(stack, lambda n: n == 0 and stack.store.delete("alice", dog))
    reply = client.post("/v1/chat/completions", json=_chat("my dog and my city?"), headers=ALICE).json()
    assert calls == [0, 1]
    assert "Miso" not in _prompt(stack) and CITY in _prompt(stack)
    assert reply["memory"]["used"] == [{"id": city, "tier": "text"}]
    changed = _search_then(
        stack, lambda n: n == 0 and stack.store.update("alice", city, text="I live in Porto.")
    )
    reply = client.post("/v1/chat/completions", json=_chat("my dog and my city?"), headers=ALICE).json()
    assert changed == [0, 1]  # a changed text is stale too: the new text is served, never the old
    assert "Lisbon" not in _prompt(stack)
    used = reply["memory"]["used"]
    assert used in ([], [{"id": city, "tier": "text"}])  # the new text, if the search finds it
    assert ("I live in Porto." in _prompt(stack)) == bool(used)


def test_a_request_whose_memories_keep_changing_is_refused_after_three_preparations(client_stack) -> None:
    """Each preparation finds a memory it carries deleted meanwhile: after MAX_PREPARES the request is refused
    with 503 memories_changed (never served with a deleted text); nothing reached the backend."""
    client, stack = client_stack
    ids = {t: stack.store.add("alice", t)[0].id for t in (DOG, CITY, TEA)}
    doomed = [ids[DOG], ids[CITY], ids[TEA]]
    calls = _search_then(stack, lambda n: stack.store.delete("alice", doomed[n]))
    response = client.post("/v1/chat/completions", json=_chat("dog city tea"), headers=ALICE)
    assert calls == [0, 1, 2]
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "memories_changed"
    assert stack.backend.requests == []


def test_a_block_memory_deleted_after_the_request_was_prepared_is_not_served(client_stack) -> None:
    """5c, the last window: the request passed its check against the store (its block and its texts were all
    live), then the dog is deleted before the backend looks the block up; the cascade dropped the block's item.
    The backend used to fall back to prefilling the block's tokens, the deleted text (kv_fallback_reason
    not_found); it now refuses the request (BlockNotFound) and the request is prepared again, without the dog."""
    client, stack = client_stack
    dog, city = (stack.store.add("alice", t)[0].id for t in (DOG, CITY))
    stack.scheduler.get("alice")
    stack.scheduler.flush()
    block = stack.scheduler.get("alice").block
    assert set(block.memory_ids) == {dog, city}
    check, checks = stack.store.memories_by_ids, []

    def check_then_delete(user_id: str, ids: list[str], **kwargs: Any) -> Any:
        live = check(user_id, ids, **kwargs)
        checks.append(sorted(ids))
        if len(checks) == 1:
            assert stack.store.delete("alice", dog) == 1  # after the request's check, before the backend
        return live

    stack.store.memories_by_ids = check_then_delete
    reply = client.post("/v1/chat/completions", json=_chat(), headers=ALICE).json()
    assert checks == [sorted([dog, city]), [city]]  # prepared twice: the second carries the city alone
    assert not stack.backend.has_block(block.item_id)
    assert len(stack.backend.requests) == 1  # the request naming the gone block never reached generation
    assert "Miso" not in _prompt(stack) and CITY in _prompt(stack)
    assert stack.backend.requests[-1].block_item_id is None
    assert reply["memory"]["used"] == [{"id": city, "tier": "text"}]
    assert reply["choices"][0]["message"]["content"] == "Hello from kvmem."
    assert 'kvmem_kv_fallbacks_total{reason="not_found"} 1' in client.get("/metrics").text
