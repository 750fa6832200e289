"""Identity and isolation: a key never reads, writes or is answered with another user's memories."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from serving.http.auth import KeyRing, KeysFileError
from tests.serving.conftest import ALICE, BOB, MODEL, TEAM, Stack, make_stack

BOB_SECRET = "bob's bank pin is 4321 and his pet is Rex"


@pytest.fixture
def seeded(stack: Stack) -> Stack:
    stack.store.add("alice", text="alice's pet is a cat named Tofu")
    stack.store.add("bob", text=BOB_SECRET)
    stack.scheduler.flush()
    return stack


def error(r) -> tuple[int, str]:
    return r.status_code, r.json()["error"]["code"]


def test_missing_and_bad_keys_are_401(client: TestClient) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
    assert error(client.post("/v1/chat/completions", json=body)) == (401, "missing_api_key")
    bad = {"Authorization": "Bearer sk-nope-0000"}
    assert error(client.post("/v1/chat/completions", json=body, headers=bad)) == (401, "invalid_api_key")
    basic = {"Authorization": "Basic sk-alice-0000"}
    assert error(client.post("/v1/chat/completions", json=body, headers=basic)) == (401, "invalid_api_key")
    assert error(client.get("/v1/models")) == (401, "missing_api_key")
    assert error(client.get("/v1/memories", params={"user_id": "alice"})) == (401, "missing_api_key")
    assert client.get("/v1/memories", params={"user_id": "alice"}, headers=bad).status_code == 401
    assert client.get("/health").status_code == 200


def test_every_memory_route_refuses_another_user(seeded: Stack, client: TestClient) -> None:
    bob_id = seeded.store.list("bob").items[0].id
    q = {"user_id": "bob"}
    calls = [
        client.post("/v1/memories", json={"user_id": "bob", "text": "planted by alice"}, headers=ALICE),
        client.post("/v1/memories/search", json={"user_id": "bob", "query": "pin"}, headers=ALICE),
        client.get("/v1/memories", params=q, headers=ALICE),
        client.get(f"/v1/memories/{bob_id}", params=q, headers=ALICE),
        client.patch(f"/v1/memories/{bob_id}", json={"user_id": "bob", "text": "x"}, headers=ALICE),
        client.delete(f"/v1/memories/{bob_id}", params=q, headers=ALICE),
        client.delete("/v1/memories", params=q, headers=ALICE),
        client.get("/v1/memories/plan", params=q, headers=ALICE),
    ]
    assert [error(r) for r in calls] == [(403, "user_not_allowed")] * len(calls)
    assert [m.text for m in seeded.store.list("bob").items] == [BOB_SECRET]


def test_own_user_id_cannot_reach_another_users_memory(seeded: Stack, client: TestClient) -> None:
    bob_id = seeded.store.list("bob").items[0].id
    mine = {"user_id": "alice"}
    assert error(client.get(f"/v1/memories/{bob_id}", params=mine, headers=ALICE)) == (
        404,
        "memory_not_found",
    )
    r = client.patch(f"/v1/memories/{bob_id}", json={"user_id": "alice", "text": "x"}, headers=ALICE)
    assert error(r) == (404, "memory_not_found")
    r = client.delete(f"/v1/memories/{bob_id}", params=mine, headers=ALICE)
    assert error(r) == (404, "memory_not_found")
    r = client.post(
        "/v1/memories/search", json={"user_id": "alice", "query": "bob pin pet Rex"}, headers=ALICE
    )
    assert BOB_SECRET not in json.dumps(r.json())
    assert seeded.store.get("bob", bob_id).text == BOB_SECRET


def test_chat_never_answers_with_another_users_memories(seeded: Stack, client: TestClient) -> None:
    ask = {"model": MODEL, "messages": [{"role": "user", "content": "what is bob's pin and his pet"}]}
    assert error(client.post("/v1/chat/completions", json={**ask, "user": "bob"}, headers=ALICE)) == (
        403,
        "user_not_allowed",
    )
    r = client.post("/v1/chat/completions", json=ask, headers=ALICE)  # a one-user key: alice implied
    assert r.status_code == 200
    r = client.post("/v1/chat/completions", json={**ask, "user": "alice"}, headers=TEAM)
    assert r.status_code == 200
    r = client.post("/v1/chat/completions", json=ask, headers={**ALICE, "X-User-Id": "bob"})
    assert error(r) == (403, "user_not_allowed")
    prompts = [seeded.backend.decode(req.prompt.ids) for req in seeded.backend.requests]
    assert len(prompts) == 2
    assert all(req.user_id == "alice" for req in seeded.backend.requests)
    assert all("4321" not in p and "Rex" not in p for p in prompts)
    assert all("Tofu" in p for p in prompts)
    alice_block = seeded.scheduler.get("alice").block.item_id
    assert {req.block_item_id for req in seeded.backend.requests} == {alice_block}
    assert alice_block != seeded.scheduler.get("bob").block.item_id


def test_multi_user_key_must_name_the_user(seeded: Stack, client: TestClient) -> None:
    ask = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    r = client.post("/v1/chat/completions", json=ask, headers=TEAM)
    assert (r.status_code, r.json()["error"]["param"]) == (400, "user")
    r = client.post("/v1/chat/completions", json={**ask, "user": "bob"}, headers=TEAM)
    assert r.status_code == 200
    assert seeded.backend.requests[-1].user_id == "bob"
    assert client.get("/v1/memories", params={"user_id": "bob"}, headers=BOB).status_code == 200
    assert error(client.get("/v1/memories", params={"user_id": "carol"}, headers=TEAM)) == (
        403,
        "user_not_allowed",
    )


def test_no_auth_accepts_any_user_and_defaults_to_demo(tmp_path: Path) -> None:
    s = make_stack(tmp_path, auth=False)
    with TestClient(s.app) as client:
        ask = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
        assert client.post("/v1/chat/completions", json=ask).status_code == 200
        assert client.post("/v1/chat/completions", json={**ask, "user": "zed"}).status_code == 200
        assert [r.user_id for r in s.backend.requests] == ["demo", "zed"]
        assert client.get("/v1/memories", params={"user_id": "anyone"}).status_code == 200
    s.scheduler.stop()


def test_keys_file_validation(tmp_path: Path) -> None:
    path = tmp_path / "k.json"
    with pytest.raises(KeysFileError, match="does not exist"):
        KeyRing.from_file(path)
    for bad in (
        "[]",
        '{"keys": {}}',
        '{"keys": {"short": ["a"]}}',
        '{"keys": {"sk-long-enough": "alice"}}',
        "{",
    ):
        path.write_text(bad)
        with pytest.raises(KeysFileError):
            KeyRing.from_file(path)
    path.write_text('{"keys": {"sk-long-enough": ["alice", "bob"]}}')
    assert KeyRing.from_file(path).caller("Bearer sk-long-enough").allowed_users == frozenset(
        {"alice", "bob"}
    )
