from __future__ import annotations

import pytest

from kvmem.text import ChangeEvent, SubscriberError


def test_events_for_every_change(store):
    seen = []
    unsubscribe = store.subscribe(seen.append)
    a, b = store.add("alice", texts=["one", "two"], session_id="s")
    store.update("alice", a.id, text="uno")
    store.update("alice", a.id, text="uno")  # no change, no event
    store.delete("alice", "missing")
    store.delete_session("alice", "s")
    assert seen == [
        ChangeEvent(a.id, "alice", "added"),
        ChangeEvent(b.id, "alice", "added"),
        ChangeEvent(a.id, "alice", "updated"),
        ChangeEvent(a.id, "alice", "deleted"),
        ChangeEvent(b.id, "alice", "deleted"),
    ]
    unsubscribe()
    store.add("alice", "three")
    assert len(seen) == 5


def test_delete_cascade_runs_before_delete_returns(store):
    """The subscriber sees the memory already gone from the store, and its invalidation is done on return."""
    [m] = store.add("alice", "hot memory")
    served = {m.id}
    observed = []

    def invalidate(event):
        observed.append(store.memories_by_ids("alice", [event.memory_id]))
        served.discard(event.memory_id)

    store.subscribe(invalidate)
    assert store.delete("alice", m.id) == 1
    assert served == set() and observed == [[]]


def test_failing_subscriber_does_not_undo_the_write(store):
    calls = []

    def broken(event):
        raise RuntimeError("boom")

    store.subscribe(broken)
    store.subscribe(calls.append)
    with pytest.raises(
        SubscriberError, match="1 subscriber call\\(s\\) failed after the write was committed"
    ):
        store.add("alice", "kept")
    assert [m.text for m in store.list("alice").items] == ["kept"]
    assert [e.kind for e in calls] == ["added"]


def test_no_event_when_the_write_fails(store):
    seen = []
    store.subscribe(seen.append)
    with pytest.raises(ValueError):
        store.add("alice", texts=["fine", ""])
    assert seen == []
