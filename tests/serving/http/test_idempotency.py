"""Memory writes a client can retry: a committed write whose post-commit hook (a store subscriber such as the
scheduler) fails is answered as committed, not 500; `Idempotency-Key` replays the first answer."""

from __future__ import annotations

import asyncio
import sqlite3

import pytest
from fastapi.testclient import TestClient

from kvmem.text.keyed_writes import TxView
from serving.http.idempotency import Answer, EventCollector, IdempotentWrites
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
    assert again.json() == deleted.json()  # without the key a repeat would be a 404
    repeat = client.delete(url, params={"user_id": "alice"}, headers=ALICE)
    assert (repeat.status_code, repeat.json()["error"]["code"]) == (404, "memory_not_found")


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


def test_concurrent_repeats_run_once_and_answers_expire(stack: Stack) -> None:
    now = [1_000.0]
    writes = IdempotentWrites(stack.store, ttl_s=10.0, clock=lambda: now[0])
    collector = EventCollector()
    stack.store.subscribe(collector)
    calls: list[str] = []

    def writer(text: str):
        async def write() -> Answer:
            calls.append(text)
            await asyncio.sleep(0.01)  # the repeat arrives while this one runs
            done = await asyncio.to_thread(collector.committed_write, stack.store.add, "alice", text)
            return Answer(201, {"ids": [m.id for m in done.value]})

        return write

    def recorded(view: TxView) -> Answer:
        return Answer(201, {"ids": view.event_ids("added", "alice")})

    async def scenario() -> None:
        a1, a2 = await asyncio.gather(
            writes.run("alice", "POST /x", "a", "f", writer("one"), recorded),
            writes.run("alice", "POST /x", "a", "f", writer("one"), recorded),
        )
        assert calls == ["one"] and a1[1] is False and a2 == (a1[0], True)
        assert stack.store.count("alice") == 1
        now[0] += 10.0  # at the TTL: still answered
        assert (await writes.run("alice", "POST /x", "a", "f", writer("one"), recorded)) == (a1[0], True)
        now[0] += 0.5  # past it: the key is free again, and its old receipt is replaced
        again = await writes.run("alice", "POST /x", "a", "f", writer("one"), recorded)
        assert again[1] is False and again[0] != a1[0] and calls == ["one", "one"]
        assert (await writes.run("alice", "POST /x", "a", "f", writer("one"), recorded)) == (again[0], True)
        assert stack.store.count("alice") == 2

    asyncio.run(scenario())
