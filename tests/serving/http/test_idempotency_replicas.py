"""Idempotency-Key across replicas: two servers over one shared store (here one SQLite file, as two processes
on one machine share it; tests/kvmem/text/test_receipts.py runs the store's side on PostgreSQL too). A POST
retried through the other replica (HAProxy's `retries` and `redispatch`) gets the first answer and is applied
once: the answer is recorded in the write's own transaction."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from tests.serving.conftest import ALICE, Stack, make_stack


@pytest.fixture
def replicas(tmp_path: Path) -> Iterator[tuple[Stack, Stack]]:
    """Two servers, each with its own store object (its own connections) over the same file and data dir."""
    pair = make_stack(tmp_path), make_stack(tmp_path)
    yield pair
    for stack in pair:
        stack.scheduler.stop()
        stack.store.close()


def _post(client: TestClient, key: str, text: str):
    body = {"user_id": "alice", "text": text, "tags": ["home"], "metadata": {"city": "Lisbon", "n": 1.5}}
    return client.post("/v1/memories", json=body, headers={**ALICE, "Idempotency-Key": key})


def test_a_post_retried_through_another_replica_gets_the_first_answer_and_is_applied_once(
    replicas: tuple[Stack, Stack],
) -> None:
    one, two = replicas
    with TestClient(one.app) as first, TestClient(two.app) as second:
        answered = _post(first, "add-1", "I live in Lisbon.")
        assert answered.status_code == 201, answered.text
        retried = _post(second, "add-1", "I live in Lisbon.")
        assert retried.status_code == 201 and retried.json() == answered.json()
        assert retried.headers["Idempotent-Replayed"] == "true"
        [memory] = answered.json()["memories"]
        assert memory == two.store.get("alice", memory["id"]).to_dict()  # the answer is what was stored
        other = _post(second, "add-1", "I live in Porto.")
        assert other.status_code == 400 and other.json()["error"]["code"] == "idempotency_key_reused"
        url = f"/v1/memories/{memory['id']}"
        deleted = second.delete(url, params={"user_id": "alice"}, headers={**ALICE, "Idempotency-Key": "d"})
        again = first.delete(url, params={"user_id": "alice"}, headers={**ALICE, "Idempotency-Key": "d"})
        assert deleted.json() == again.json() == {"deleted": 1}
        assert again.headers["Idempotent-Replayed"] == "true"
    assert one.store.count("alice") == 0 and two.store.list("alice").total == 0


def test_a_repeat_racing_the_first_on_another_replica_is_rolled_back_and_replayed(
    replicas: tuple[Stack, Stack], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The repeat's look-up ran before the first committed (both were in flight): its own write transaction
    finds the first's answer, writes nothing, and replays it."""
    one, two = replicas
    with TestClient(one.app) as first, TestClient(two.app) as second:
        answered = _post(first, "add-2", "I have a dog named Rex.")
        assert answered.status_code == 201, answered.text
        monkeypatch.setattr(two.store, "find_receipt", lambda *a: None, raising=False)  # looked too early
        retried = _post(second, "add-2", "I have a dog named Rex.")
        assert retried.status_code == 201 and retried.json() == answered.json()
        assert retried.headers["Idempotent-Replayed"] == "true"
        other = _post(second, "add-2", "I have a cat.")
        assert other.status_code == 400 and other.json()["error"]["code"] == "idempotency_key_reused"
    assert [m.text for m in one.store.list("alice").items] == ["I have a dog named Rex."]
