"""The stand-in plan provider: budgeted choice, built off the request path, invalidated by store changes."""

from __future__ import annotations

from datetime import datetime, timezone

from kvmem.text import HashEmbedder, MemoryStore
from serving.backends.fake import FakeBackend
from serving.plans import AccessEvent, Plan, StandInPlanProvider

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


def provider(store: MemoryStore, backend: FakeBackend, budget: int) -> StandInPlanProvider:
    return StandInPlanProvider(store, backend, token_budget=budget, clock=lambda: T0)


def test_first_get_is_empty_then_block_is_built_once(tmp_path) -> None:
    store, backend = MemoryStore(tmp_path / "m.sqlite", embedder=HashEmbedder()), FakeBackend()
    _, b, c = store.add("u", texts=["aaaa", "bbbbbb", "cc"])
    plans = provider(store, backend, budget=8)
    assert plans.get("u") == Plan(user_id="u")  # never waits for the build
    plans.flush()
    plan = plans.get("u")
    # newest first (c, b, a); a (4 tokens) no longer fits after c (2) + b (6)
    assert plan.block_memory_ids == (c.id, b.id)
    assert plan.block_texts == ("cc", "bbbbbb")
    n = backend.layout_prompt(["cc", "bbbbbb"], [], []).block_len
    assert (plan.block_tokens, plan.block_bytes, plan.updated_at) == (n, 4 * n, T0)
    assert backend.has_block(plan.block_item_id)
    for _ in range(3):
        plans.get("u")
    plans.flush()
    assert backend.built == [("u", ("cc", "bbbbbb"))]
    plans.close()


def test_update_or_delete_of_a_covered_memory_drops_the_block_at_once(tmp_path) -> None:
    store, backend = MemoryStore(tmp_path / "m.sqlite", embedder=HashEmbedder()), FakeBackend()
    a, b = store.add("u", texts=["one", "two"])
    plans = provider(store, backend, budget=100)
    plans.get("u")
    plans.flush()
    old = plans.get("u")
    store.update("u", a.id, text="uno")
    assert plans.get("u").block_item_id is None  # before any rebuild
    assert not backend.has_block(old.block_item_id)
    plans.flush()
    assert plans.get("u").block_texts == ("two", "uno")
    store.delete("u", b.id)
    assert plans.get("u").block_memory_ids == ()
    plans.flush()
    assert plans.get("u").block_texts == ("uno",)
    plans.close()


def test_other_users_changes_and_adds_leave_a_block_alone(tmp_path) -> None:
    store, backend = MemoryStore(tmp_path / "m.sqlite", embedder=HashEmbedder()), FakeBackend()
    store.add("u", text="mine")
    plans = provider(store, backend, budget=100)
    plans.get("u")
    plans.flush()
    before = plans.get("u")
    (theirs,) = store.add("v", text="theirs")
    store.delete("v", theirs.id)
    store.add("u", text="new one")
    plans.get("u")
    plans.flush()
    assert plans.get("u") == before
    plans.close()


def test_empty_user_gets_a_block_after_adding_memories(tmp_path) -> None:
    store, backend = MemoryStore(tmp_path / "m.sqlite", embedder=HashEmbedder()), FakeBackend()
    plans = provider(store, backend, budget=100)
    plans.get("u")
    plans.flush()
    assert plans.get("u").block_item_id is None
    store.add("u", text="hello")
    plans.get("u")
    plans.flush()
    assert plans.get("u").block_texts == ("hello",)
    plans.close()


def test_not_ready_backend_or_zero_budget_builds_nothing(tmp_path) -> None:
    store = MemoryStore(tmp_path / "m.sqlite", embedder=HashEmbedder())
    store.add("u", text="x")
    backend = FakeBackend(ready=False)
    plans = provider(store, backend, budget=100)
    plans.get("u")
    plans.flush()
    assert backend.built == [] and plans.get("u") == Plan(user_id="u")
    plans.close()
    backend = FakeBackend()
    plans = provider(store, backend, budget=0)
    plans.get("u")
    plans.flush()
    assert backend.built == []
    plans.close()


def test_record_access_keeps_a_bounded_log(tmp_path) -> None:
    plans = StandInPlanProvider(
        MemoryStore(tmp_path / "m.sqlite", embedder=HashEmbedder()),
        FakeBackend(),
        token_budget=10,
        max_events=2,
    )
    for i in range(3):
        plans.record_access(AccessEvent(user_id="u", query=str(i), retrieved_ids=(), used_ids=()))
    assert [e.query for e in plans.events] == ["1", "2"]
    plans.close()
