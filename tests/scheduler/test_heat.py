"""Heat: an access event counts once, even when it is delivered twice (a Redis redelivery, a retried task),
across a restart, and only within the replay window."""

from __future__ import annotations

from scheduler import AccessEvent
from scheduler.heat import REPLAY_WINDOW_S, HeatTable


def table(path) -> HeatTable:
    return HeatTable(path, half_life_s=10.0, use_weight=2.0, recency_prior=0.0)


def test_a_replayed_access_event_counts_once_across_a_restart(tmp_path):
    event = AccessEvent("u", ("a", "b"), ("a",), 10.0)
    heat = table(tmp_path / "h.sqlite")
    assert heat.apply(event) is True and heat.apply(event) is False
    assert heat.apply(AccessEvent("u", ("a", "b"), ("a",), 10.0, "s1")) is True  # another session: new event
    heat.close()
    again = table(tmp_path / "h.sqlite")
    assert again.apply(event) is False
    stats = again.stats("u")
    assert (stats["a"].hits, stats["a"].uses, stats["a"].score_now(10.0, 10.0)) == (2, 2, 6.0)
    assert (stats["b"].hits, stats["b"].uses, stats["b"].score_now(20.0, 10.0)) == (2, 0, 1.0)


def test_replay_keys_expire_after_the_window(tmp_path):
    heat = table(None)
    first = AccessEvent("u", ("a",), (), 0.0)
    assert heat.apply(first)
    assert heat.apply(AccessEvent("u", ("b",), (), REPLAY_WINDOW_S + 1.0))  # prunes the first key
    assert heat.apply(first) is True
    heat.forget("u")
    assert heat.stats("u") == {} and heat.apply(first) is True


def test_heat_held_in_memory_is_lru_bounded_and_the_rest_stays_in_the_file(tmp_path):
    from scheduler.heat import AccessEvent as Event
    from scheduler.heat import HeatTable as Table

    heat = Table(tmp_path / "heat.sqlite", half_life_s=10.0, use_weight=2.0, recency_prior=0.5, max_users=2)
    for i in range(100):
        heat.seen(f"user-{i}", "m", float(i))
    assert list(heat._stats) == ["user-98", "user-99"] and len(heat._applied) <= 2
    assert heat.num_tracked() == 100 and len(heat.users()) == 100
    assert heat.stats("user-3")["m"].first_seen == 3.0  # read back from the file
    assert list(heat._stats) == ["user-99", "user-3"]
    event = Event("user-3", ("m",), (), 5.0)
    assert heat.apply(event) is True
    for i in range(10):
        heat.stats(f"user-{i + 50}")  # user-3 leaves memory, its applied keys too ...
    assert "user-3" not in heat._stats and heat.apply(event) is False  # ... and a replay is still recognised
    heat.close()
