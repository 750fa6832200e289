"""What the server remembers per client-chosen key is bounded (fake backend + the server's own scheduler):
sessions seen for prewarm, and users' plans, whose blocks are restored when a dropped user returns."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from scheduler import SchedulerConfig
from serving.config import ServingConfig
from tests.serving.conftest import ALICE, BOB, MODEL, make_stack


def chat(client: TestClient, headers: dict, session: str | None = None) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    extra = {} if session is None else {"X-Session-Id": session}
    return client.post("/v1/chat/completions", json=body, headers={**headers, **extra}).json()


def test_past_max_sessions_the_least_recent_session_is_forgotten(tmp_path: Path) -> None:
    stack = make_stack(tmp_path, max_sessions=3, store_turns=False)
    sessions = stack.app.state.chat

    put, seen = stack.scheduler.queue.put, []
    stack.scheduler.queue.put = lambda task: seen.append(task) or put(task)  # what the sessions ask

    def prewarms() -> list[str]:  # asked since the last call (the queue merges a user's waiting ones)
        out = [t.user_id for t in seen if t.kind == "prewarm"]
        seen.clear()
        return out

    with TestClient(stack.app) as client:
        for s in ("s0", "s1", "s2", "s3"):  # N + 1 distinct sessions
            chat(client, ALICE, s)
        assert sessions.sessions == (("alice", "s1"), ("alice", "s2"), ("alice", "s3"))  # s0 gone
        assert prewarms() == ["alice"] * 4
        chat(client, ALICE, "s1")  # remembered: no prewarm; now the most recent
        assert prewarms() == []
        chat(client, ALICE, "s0")  # forgotten: a first turn again, so it prewarms; s2 is the oldest now
        assert prewarms() == ["alice"]
        assert sessions.sessions == (("alice", "s3"), ("alice", "s1"), ("alice", "s0"))
    stack.scheduler.stop()


def test_max_sessions_is_validated() -> None:
    with pytest.raises(ValueError, match="max_sessions must be >= 1, got 0"):
        ServingConfig(max_sessions=0)


def test_a_dropped_plan_is_restored_on_the_users_next_turn(tmp_path: Path) -> None:
    stack = make_stack(tmp_path, scheduler_config=SchedulerConfig(max_plans=1), store_turns=False)
    [memory] = stack.store.add("alice", text="alice likes jazz")
    stack.scheduler.flush()
    block = stack.scheduler.get("alice").block
    assert block.memory_ids == (memory.id,)
    with TestClient(stack.app) as client:
        chat(client, BOB)  # a second user: the book holds one, so alice's plan leaves memory
        assert stack.scheduler.plans.users() == ["bob"]
        assert stack.backend.has_block(block.item_id)  # dropped from memory only: the item stays stored
        out = chat(client, ALICE)  # served as text this once; the read asks for alice's plan again
        assert out["memory"]["used"] == [{"id": memory.id, "tier": "text"}]
        stack.scheduler.flush()
        assert stack.scheduler.get("alice").block == block  # the same content-addressed item, restored
        out = chat(client, ALICE)
        assert out["memory"]["used"] == [{"id": memory.id, "tier": "kv"}]
    stack.scheduler.stop()
