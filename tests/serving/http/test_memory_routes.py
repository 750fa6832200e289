"""The memory routes of API.md, with exact JSON (memory bodies are the store's own `to_dict()`)."""

from __future__ import annotations

from datetime import datetime, timezone

from fastapi.testclient import TestClient

from tests.serving.conftest import ALICE, Stack


def test_add_get_list_search_update_delete(stack: Stack, client: TestClient) -> None:
    r = client.post(
        "/v1/memories",
        json={
            "user_id": "alice",
            "text": "I live in Lisbon",
            "session_id": "s1",
            "tags": ["home"],
            "metadata": {"src": "t"},
            "chat_time": "2026-01-02T03:04:05+00:00",
        },
        headers=ALICE,
    )
    assert r.status_code == 201
    (m,) = r.json()["memories"]
    stored = stack.store.get("alice", m["id"])
    assert r.json() == {"memories": [stored.to_dict()]}
    assert (m["text"], m["session_id"], m["tags"], m["metadata"]) == (
        "I live in Lisbon",
        "s1",
        ["home"],
        {"src": "t"},
    )

    r = client.post(
        "/v1/memories",
        json={"user_id": "alice", "messages": [{"role": "user", "content": "I like figs"}]},
        headers=ALICE,
    )
    assert r.status_code == 201
    second = r.json()["memories"][0]["id"]

    r = client.get(f"/v1/memories/{m['id']}", params={"user_id": "alice"}, headers=ALICE)
    assert r.status_code == 200 and r.json() == stored.to_dict()

    r = client.get("/v1/memories", params={"user_id": "alice", "page": 1, "page_size": 1}, headers=ALICE)
    page = stack.store.list("alice", page=1, page_size=1)
    assert r.json() == {"data": [x.to_dict() for x in page.items], "page": 1, "page_size": 1, "total": 2}
    r = client.get("/v1/memories", params={"user_id": "alice", "session_id": "s1"}, headers=ALICE)
    assert r.json() == {"data": [stored.to_dict()], "page": 1, "page_size": 20, "total": 1}

    r = client.post(
        "/v1/memories/search", json={"user_id": "alice", "query": "where do I live Lisbon"}, headers=ALICE
    )
    hits = stack.store.search("alice", "where do I live Lisbon", top_k=10)
    assert r.json() == {"results": [{**h.memory.to_dict(), "score": h.score, "tier": "text"} for h in hits]}
    assert r.json()["results"][0]["id"] == m["id"]

    r = client.patch(
        f"/v1/memories/{m['id']}", json={"user_id": "alice", "text": "I live in Porto"}, headers=ALICE
    )
    assert r.status_code == 200
    assert r.json() == stack.store.get("alice", m["id"]).to_dict()
    assert r.json()["text"] == "I live in Porto"

    r = client.delete(f"/v1/memories/{m['id']}", params={"user_id": "alice"}, headers=ALICE)
    assert r.json() == {"deleted": 1}
    r = client.get(f"/v1/memories/{m['id']}", params={"user_id": "alice"}, headers=ALICE)
    assert r.status_code == 404
    assert r.json() == {
        "error": {
            "message": "memory not found",
            "type": "invalid_request_error",
            "param": None,
            "code": "memory_not_found",
        }
    }
    assert client.delete("/v1/memories", params={"user_id": "alice"}, headers=ALICE).json() == {"deleted": 1}
    assert stack.store.count("alice") == 0
    assert second not in {x.id for x in stack.store.list("alice").items}


def test_delete_one_session(stack: Stack, client: TestClient) -> None:
    stack.store.add("alice", texts=["a one", "a two"], session_id="s1")
    stack.store.add("alice", text="a three", session_id="s2")
    r = client.delete("/v1/memories", params={"user_id": "alice", "session_id": "s1"}, headers=ALICE)
    assert r.json() == {"deleted": 2}
    assert [m.text for m in stack.store.list("alice").items] == ["a three"]


def plan_route(client: TestClient) -> tuple[dict, dict]:
    """The plan body and, apart, its `scheduler` extension."""
    body = client.get("/v1/memories/plan", params={"user_id": "alice"}, headers=ALICE).json()
    return body, body.pop("scheduler")


def test_plan_route_and_invalidation(stack: Stack, client: TestClient) -> None:
    body, _ = plan_route(client)
    assert body == {
        "block": None,
        "adapter": None,
        "updated_at": None,
        "kv": None,  # no block (the fake backend says nothing of tiers either)
    }
    ids = [m.id for m in stack.store.add("alice", texts=["x likes y", "z likes w"])]
    stack.scheduler.flush()  # the adds scheduled the build
    plan = stack.scheduler.get("alice")
    n = stack.backend.layout_prompt(["z likes w", "x likes y"], [], []).block_len
    body, sched = plan_route(client)
    assert (sched["num_blocks"], sched["block_memories"], sched["block_tokens"]) == (1, 2, n)
    assert body == {
        "block": {
            "item_id": plan.block.item_id,
            "memory_ids": ids,
            "tokens": n,
            "bytes": 4 * n,
            "tier": "kv",
            "adapter": None,  # the base model's K/V
        },
        "adapter": None,
        "updated_at": datetime.fromtimestamp(plan.updated_at, timezone.utc).isoformat(),
        "kv": None,  # the fake backend does not say where its blocks are (Backend.block_residency)
    }
    r = client.post("/v1/memories/search", json={"user_id": "alice", "query": "likes"}, headers=ALICE)
    assert [h["tier"] for h in r.json()["results"]] == ["kv", "kv"]
    # deleting a covered memory stops the block being served before the call returns
    assert client.delete(f"/v1/memories/{ids[0]}", params={"user_id": "alice"}, headers=ALICE).json() == {
        "deleted": 1
    }
    assert not stack.backend.has_block(plan.block.item_id)
    assert plan_route(client)[0]["block"] is None


def test_memory_route_errors(client: TestClient) -> None:
    def err(r) -> tuple[int, str | None]:
        return r.status_code, r.json()["error"]["param"]

    assert err(client.post("/v1/memories", json={"user_id": "alice"}, headers=ALICE)) == (400, "text")
    both = {"user_id": "alice", "text": "a", "messages": [{"role": "user", "content": "b"}]}
    assert err(client.post("/v1/memories", json=both, headers=ALICE)) == (400, "text")
    assert err(client.post("/v1/memories", json={"user_id": "", "text": "a"}, headers=ALICE)) == (
        400,
        "user_id",
    )
    assert err(client.post("/v1/memories", json={"user_id": "alice", "text": 5}, headers=ALICE)) == (
        400,
        "text",
    )
    r = client.post("/v1/memories/search", json={"user_id": "alice", "query": "q", "top_k": 0}, headers=ALICE)
    assert err(r) == (400, "top_k")
    assert err(client.get("/v1/memories", headers=ALICE)) == (400, "user_id")
    r = client.get("/v1/memories", params={"user_id": "alice", "page": 0}, headers=ALICE)
    assert err(r) == (400, "page")
    for raw in (
        '{"user_id": "alice", "text": "x", "metadata": {"a": NaN}}',
        '{"user_id": "alice", "text": "x", "metadata": {"a": Infinity}}',
        '{"user_id": "alice", "text": "\\ud800"}',
    ):
        r = client.post("/v1/memories", content=raw, headers={**ALICE, "content-type": "application/json"})
        assert (r.status_code, r.json()["error"]["type"]) == (400, "invalid_request_error"), raw
    r = client.get("/v1/memories/nope", params={"user_id": "alice"}, headers=ALICE)
    assert (r.status_code, r.json()["error"]["code"]) == (404, "memory_not_found")


def test_a_superseded_memory_lists_its_state_as_superseded(stack: Stack, client: TestClient) -> None:
    """It listed "state": "active" (the stored column) while it was neither served nor current."""
    old, new = stack.store.add("alice", texts=["I live in Berlin", "I live in Paris"])
    stack.store.supersede("alice", old.id, new.id)
    shown = {"user_id": "alice", "include_superseded": "true"}
    listed = client.get("/v1/memories", params=shown, headers=ALICE).json()["data"]
    assert sorted((m["text"], m["state"], m["superseded_by"]) for m in listed) == [
        ("I live in Berlin", "superseded", new.id),
        ("I live in Paris", "active", None),
    ]
    got = client.get(f"/v1/memories/{old.id}", params={"user_id": "alice"}, headers=ALICE).json()
    assert (got["state"], got["superseded_by"]) == ("superseded", new.id)
    hits = client.post(
        "/v1/memories/search",
        json={"user_id": "alice", "query": "where do I live", "include_superseded": True},
        headers=ALICE,
    ).json()["results"]
    assert {m["text"]: m["state"] for m in hits} == {
        "I live in Berlin": "superseded",
        "I live in Paris": "active",
    }
    stack.store.update("alice", new.id, state="archived")  # archived by the user: says so, superseded or not
    assert client.get(f"/v1/memories/{new.id}", params={"user_id": "alice"}, headers=ALICE).json()[
        "state"
    ] == ("archived")


def test_delete_of_an_unknown_memory_is_a_404_like_patch(stack: Stack, client: TestClient) -> None:
    """It answered 200 {"deleted": 0} where PATCH answered 404; the delete of all of a user's memories (or a
    session's) still counts what it deleted, 0 included."""
    not_found = {
        "error": {
            "message": "memory not found",
            "type": "invalid_request_error",
            "param": None,
            "code": "memory_not_found",
        }
    }
    (kept,) = stack.store.add("alice", "I keep bees")
    (bobs,) = stack.store.add("bob", "bob keeps wasps")
    alice = {"user_id": "alice"}
    for memory_id in ("no-such-id", bobs.id):  # absent, and another user's
        r = client.patch(f"/v1/memories/{memory_id}", json={**alice, "text": "x"}, headers=ALICE)
        assert (r.status_code, r.json()) == (404, not_found)
        r = client.delete(f"/v1/memories/{memory_id}", params=alice, headers=ALICE)
        assert (r.status_code, r.json()) == (404, not_found)
    assert stack.store.get("bob", bobs.id) == bobs

    keyed = {**ALICE, "Idempotency-Key": "k1"}
    r = client.delete(f"/v1/memories/{kept.id}", params=alice, headers=keyed)
    assert (r.status_code, r.json()) == (200, {"deleted": 1})
    r = client.delete(f"/v1/memories/{kept.id}", params=alice, headers=keyed)  # a retry: the first answer
    assert (r.status_code, r.json(), r.headers["Idempotent-Replayed"]) == (200, {"deleted": 1}, "true")
    r = client.delete(f"/v1/memories/{kept.id}", params=alice, headers=ALICE)  # deleted: not found now
    assert (r.status_code, r.json()) == (404, not_found)
    for _ in range(2):  # a keyed delete of an unknown id: 404, and nothing recorded for its key
        r = client.delete("/v1/memories/no-such-id", params=alice, headers={**ALICE, "Idempotency-Key": "k2"})
        assert (r.status_code, r.json()) == (404, not_found) and "Idempotent-Replayed" not in r.headers

    r = client.delete("/v1/memories", params={**alice, "session_id": "nothing-here"}, headers=ALICE)
    assert (r.status_code, r.json()) == (200, {"deleted": 0})
    r = client.delete("/v1/memories", params=alice, headers=ALICE)
    assert (r.status_code, r.json()) == (200, {"deleted": 0})


def test_a_patched_text_takes_its_own_slot_so_a_later_fact_about_the_old_one_does_not_retire_it(
    stack: Stack, client: TestClient
) -> None:
    """PATCH kept the old text's slot: "I live in Lisbon." rewritten as a cat's name stayed `user|home_city`,
    and a later "I moved to Berlin." superseded the cat."""
    from kvmem.formation.rules import RuleExtractor
    from scheduler.formation import FormationWorker

    alice = {"user_id": "alice"}
    added = client.post("/v1/memories", json={**alice, "text": "I live in Lisbon."}, headers=ALICE).json()
    memory_id = added["memories"][0]["id"]
    assert stack.store.get("alice", memory_id).slot == "user|home_city"
    r = client.patch(
        f"/v1/memories/{memory_id}", json={**alice, "text": "I have a cat named Tom."}, headers=ALICE
    )
    assert r.status_code == 200
    cat = stack.store.get("alice", memory_id)
    assert (cat.slot, cat.slot_value) == ("user|cat.name", "tom")
    r = client.patch(
        f"/v1/memories/{memory_id}", json={**alice, "text": "The weather was nice."}, headers=ALICE
    )
    assert (stack.store.get("alice", memory_id).slot, stack.store.get("alice", memory_id).slot_value) == (
        None,
        None,
    )
    client.patch(
        f"/v1/memories/{memory_id}", json={**alice, "text": "I have a cat named Tom."}, headers=ALICE
    )
    stack.store.log_turns("alice", [{"role": "user", "content": "I moved to Berlin."}])
    assert FormationWorker(stack.store, RuleExtractor()).form_user("alice").num_superseded == 0
    assert sorted(m.text for m in stack.store.list("alice", page_size=10).items) == [
        "I have a cat named Tom.",
        "I moved to Berlin.",
    ]


def test_times_before_the_year_1000_keep_four_digits_and_times_out_of_range_are_a_400(
    client: TestClient,
) -> None:
    """A year before 1000 was stored as "999-06-01T..." (not ISO 8601, and after "2100-..." as text, so a
    time filter from 2100 found it); a time that leaves datetime's range once in UTC was a 500."""
    alice = {"user_id": "alice"}
    r = client.post(
        "/v1/memories",
        json={**alice, "text": "old event", "chat_time": "0999-06-01T00:00:00Z"},
        headers=ALICE,
    )
    assert r.status_code == 201 and r.json()["memories"][0]["chat_time"] == "0999-06-01T00:00:00.000000Z"
    later = {"time_range": {"start": "2100-01-01T00:00:00Z"}}
    r = client.post("/v1/memories/search", json={**alice, "query": "event", "filters": later}, headers=ALICE)
    assert r.status_code == 200 and r.json()["results"] == []
    for when in ("0001-01-01T00:00:00+14:00", "9999-12-31T23:59:59-14:00"):
        add = client.post("/v1/memories", json={**alice, "text": "x", "chat_time": when}, headers=ALICE)
        search = client.post(
            "/v1/memories/search",
            json={**alice, "query": "x", "filters": {"time_range": {"start": when}}},
            headers=ALICE,
        )
        turns = client.get("/v1/memories/turns", params={**alice, "start": when}, headers=ALICE)
        assert [add.status_code, search.status_code, turns.status_code] == [400, 400, 400], when
        assert "out of range once in UTC" in add.json()["error"]["message"]
