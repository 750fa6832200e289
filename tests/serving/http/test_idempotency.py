"""Memory writes a client can retry: a committed write whose post-commit hook (a store subscriber such as the
scheduler) fails is answered as committed, not 500; `Idempotency-Key` replays the first answer."""

from __future__ import annotations

import asyncio
import sqlite3

import pytest
from fastapi.testclient import TestClient

from serving.http.idempotency import Answer, IdempotencyCache
from tests.serving.conftest import ALICE, TEAM, Stack


def _break_hooks(stack: Stack) -> list[str]:
    """A store subscriber that raises after every commit, as a failing scheduler hook would."""
    heard: list[str] = []

    def broken(event: object) -> None:
        heard.append(event.kind)
        raise RuntimeError("scheduler hook exploded")

    stack.store.subscribe(broken)
    return heard


def _add(client: TestClient, key: str | None = None, text: str = "I live in Lisbon.", user: str = "alice"):
    headers = {**(ALICE if user == "alice" else TEAM), **({"Idempotency-Key": key} if key else {})}
    return client.post("/v1/memories", json={"user_id": user, "text": text}, headers=headers)


def test_a_committed_add_whose_hook_fails_is_201_and_a_retry_stores_nothing(
    client: TestClient, stack: Stack
) -> None:
    heard = _break_hooks(stack)
    first = _add(client, key="add-1")
    assert first.status_code == 201, first.text
    [memory] = first.json()["memories"]
    assert memory["text"] == "I live in Lisbon." and heard == ["added"]
    assert (
        "committed" in first.json()["warnings"][0]
        and "scheduler hook exploded" in first.json()["warnings"][0]
    )
    again = _add(client, key="add-1")
    assert again.status_code == 201 and again.json() == first.json()
    assert again.headers["Idempotent-Replayed"] == "true" and "Idempotent-Replayed" not in first.headers
    assert stack.store.count("alice") == 1 and heard == ["added"]


def test_update_and_delete_whose_hook_fails_report_what_was_committed(
    client: TestClient, stack: Stack
) -> None:
    [memory] = _add(client).json()["memories"]
    _break_hooks(stack)
    url = f"/v1/memories/{memory['id']}"
    patched = client.patch(url, json={"user_id": "alice", "text": "I live in Porto."}, headers=ALICE)
    assert patched.status_code == 200, patched.text
    assert patched.json()["text"] == "I live in Porto." and patched.json()["version"] == memory["version"] + 1
    assert patched.json()["warnings"]
    deleted = client.delete(url, params={"user_id": "alice"}, headers={**ALICE, "Idempotency-Key": "d-1"})
    assert deleted.status_code == 200 and deleted.json()["deleted"] == 1 and deleted.json()["warnings"]
    again = client.delete(url, params={"user_id": "alice"}, headers={**ALICE, "Idempotency-Key": "d-1"})
    assert again.json() == deleted.json()  # without the key a repeat would say 0
    assert client.delete(url, params={"user_id": "alice"}, headers=ALICE).json() == {"deleted": 0}


def test_a_key_is_per_user_and_route_and_refuses_another_request(client: TestClient, stack: Stack) -> None:
    alice = _add(client, key="k", text="I like tea.", user="alice")
    bob = _add(client, key="k", text="I like tea.", user="bob")
    assert alice.json()["memories"][0]["id"] != bob.json()["memories"][0]["id"]
    other = _add(client, key="k", text="I like coffee.")
    assert other.status_code == 400 and other.json()["error"]["code"] == "idempotency_key_reused"
    wiped = client.delete(
        "/v1/memories", params={"user_id": "alice"}, headers={**ALICE, "Idempotency-Key": "k"}
    )
    assert wiped.json() == {"deleted": 1}  # the same key on another route is another request
    assert client.delete(
        "/v1/memories", params={"user_id": "alice"}, headers={**ALICE, "Idempotency-Key": "k"}
    ).json() == {"deleted": 1}
    assert stack.store.count("alice") == 0 and stack.store.count("bob") == 1


def test_a_failed_write_is_not_remembered(
    client: TestClient, stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    with monkeypatch.context() as m:

        def full(*args: object, **kwargs: object) -> None:
            raise sqlite3.OperationalError("database or disk is full")

        m.setattr(stack.store, "add", full)
        assert _add(client, key="retry-me").status_code == 507
    assert _add(client, key="retry-me").status_code == 201
    assert stack.store.count("alice") == 1


def test_cache_bounds_and_concurrent_repeats() -> None:
    now = [0.0]
    cache = IdempotencyCache(ttl_s=10.0, max_entries=2, clock=lambda: now[0])
    calls: list[str] = []

    def writer(name: str):
        async def write() -> Answer:
            calls.append(name)
            await asyncio.sleep(0.01)
            return Answer(201, {"n": len(calls)})

        return write

    async def scenario() -> None:
        a1, a2 = await asyncio.gather(
            cache.run(("u", "a"), "f", writer("a")), cache.run(("u", "a"), "f", writer("a"))
        )
        assert calls == ["a"] and a1 == (Answer(201, {"n": 1}), False) and a2 == (Answer(201, {"n": 1}), True)
        await cache.run(("u", "b"), "f", writer("b"))
        await cache.run(("u", "c"), "f", writer("c"))  # over max_entries: "a", the oldest, is forgotten
        assert len(cache) == 2
        assert (await cache.run(("u", "a"), "f", writer("a")))[1] is False
        now[0] = 11.0  # past the TTL: "c" runs again
        assert (await cache.run(("u", "c"), "f", writer("c")))[1] is False
        assert calls == ["a", "b", "c", "a", "c"]

    asyncio.run(scenario())
