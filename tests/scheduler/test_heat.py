"""Heat: an access event counts once, even when it is delivered twice (a Redis redelivery, a retried task),
across a restart, and only within the replay window. Persisted heat is tested on both databases: a SQLite
file, and a PostgreSQL database (the store's, shared by replicas; tests/pg.py's server)."""

from __future__ import annotations

import pytest

from scheduler import AccessEvent
from scheduler.heat import REPLAY_WINDOW_S, HeatTable
from tests.pg import pg_server, pg_url  # noqa: F401  (fixtures)


def table(path) -> HeatTable:
    return HeatTable(path, half_life_s=10.0, use_weight=2.0, recency_prior=0.0)


@pytest.fixture(params=["sqlite", "postgresql"])
def heat_location(request, tmp_path) -> str:
    """Where persisted heat lives: a SQLite file, or a fresh PostgreSQL database's URL."""
    if request.param == "sqlite":
        return str(tmp_path / "heat.sqlite")
    return request.getfixturevalue("pg_url")


def test_a_replayed_access_event_counts_once_across_a_restart(heat_location):
    event = AccessEvent("u", ("a", "b"), ("a",), 10.0)
    heat = table(heat_location)
    assert heat.apply(event) is True and heat.apply(event) is False
    assert heat.apply(AccessEvent("u", ("a", "b"), ("a",), 10.0, "s1")) is True  # another session: new event
    heat.close()
    again = table(heat_location)
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


def test_heat_held_in_memory_is_lru_bounded_and_the_rest_stays_in_the_file(heat_location):
    from scheduler.heat import AccessEvent as Event
    from scheduler.heat import HeatTable as Table

    heat = Table(heat_location, half_life_s=10.0, use_weight=2.0, recency_prior=0.5, max_users=2)
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


def test_forget_many_and_forget_reach_the_database(heat_location):
    heat = table(heat_location)
    heat.seen_many("u", [(f"m{i}", float(i)) for i in range(600)])  # past one IN (...) chunk
    heat.seen("v", "m0", 1.0)
    heat.forget_many("u", [f"m{i}" for i in range(0, 600, 2)])
    heat.close()
    again = table(heat_location)
    assert sorted(again.stats("u")) == sorted(f"m{i}" for i in range(1, 600, 2))
    again.forget("u")
    assert again.num_tracked() == 1 and again.users() == ["v"]
    again.close()


def test_replicas_share_heat_on_postgresql(pg_url):  # noqa: F811  (the fixture)
    one, two = table(pg_url), table(pg_url)
    event = AccessEvent("u", ("a",), ("a",), 10.0)
    assert one.apply(event) is True
    assert two.apply(event) is False  # the replay key is in the shared database: a redelivery elsewhere
    assert two.stats("u")["a"].uses == 1
    reader = HeatTable(pg_url, half_life_s=10.0, use_weight=2.0, recency_prior=0.0, read_only=True)
    assert reader.stats("u")["a"].hits == 1  # the offline build's read-only copy
    for heat in (one, two, reader):
        heat.close()


def test_a_scheduler_over_a_postgresql_store_keeps_heat_in_its_database(pg_url, tmp_path):  # noqa: F811
    from kvmem.text import HashEmbedder, MemoryStore
    from scheduler import Scheduler, SchedulerConfig
    from tests.scheduler.test_scheduler import FakeBuilder

    store = MemoryStore(pg_url, embedder=HashEmbedder())
    config = SchedulerConfig(half_life_s=10.0, recency_prior=0.0, use_weight=2.0)
    make = lambda: Scheduler(config, store, FakeBuilder(), len, heat_path=tmp_path / "heat.sqlite")  # noqa: E731
    first = make()
    first.heat.apply(AccessEvent("u", ("a",), (), 1.0))
    first.heat.close()
    assert not (tmp_path / "heat.sqlite").exists()  # not the data dir's file: the shared database
    second = make()  # another replica
    assert second.heat.stats("u")["a"].hits == 1
    second.heat.close()
    store.close()
