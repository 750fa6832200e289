"""Hardening of the scheduler's request and delete paths: bookkeeping that fails never keeps a deleted memory
servable, heat of deleted memories stays gone, a whole-user delete is one cascade, the queue is coalesced and
bounded, reads never build, per-user caches are bounded."""

from __future__ import annotations

import sqlite3

from kvmem.adapters.active import AdapterPeek
from scheduler import AccessEvent, Scheduler, SchedulerConfig
from scheduler.queue import InProcessQueue, Task
from tests.scheduler.test_scheduler import Built, env, words  # noqa: F401 - env is a fixture

__all__ = ["env"]


def _raise(*_args, **_kwargs):
    raise sqlite3.OperationalError("disk I/O error")


def test_delete_withdraws_the_block_even_when_heat_writes_fail(env):  # noqa: F811
    clock, store, builder, make = env
    sched = make()
    a, b = (m.id for m in store.add("alice", texts=["cat named Miso", "lives in Lisbon"]))
    sched.get("alice")
    sched.run_pending()
    assert sched.get("alice").covered_ids == {a, b}
    # the heat store cannot be written (a full disk, a locked file): bookkeeping fails, the delete must not
    sched.heat._put = _raise
    sched.heat.forget = _raise
    sched.heat.forget_many = _raise
    assert store.delete("alice", a) == 1  # no SubscriberError: the call answers
    assert sched.get("alice").block is None and builder.dropped == ["item-1"]
    store.update("alice", b, text="lives in Porto")  # a change too: its heat write fails, serving stops
    assert sched.get("alice").block is None
    store.add("alice", "likes tea")  # and an add answers


def test_access_queued_before_a_delete_does_not_bring_heat_back(env):  # noqa: F811
    clock, store, builder, make = env
    sched = make()
    a, b = (m.id for m in store.add("alice", texts=["cat named Miso", "lives in Lisbon"]))
    sched.run_pending()
    sched.record_access(AccessEvent("alice", (a, b), (a,), clock.t))  # queued, not yet run
    store.delete("alice", a)
    sched.run_pending()
    assert set(sched.heat.stats("alice")) == {b}
    assert sched.heat.stats("alice")[b].hits == 1


def test_deleting_all_of_a_users_memories_is_one_cascade_in_one_transaction(env, tmp_path):  # noqa: F811
    clock, store, builder, make = env
    forgets: list[tuple[str, tuple[str, ...] | None]] = []
    builder.forget = lambda user_id, ids: forgets.append((user_id, None if ids is None else tuple(ids))) or []

    sched = _scheduler(store, builder, clock, heat_path=tmp_path / "heat.sqlite")
    ids = [m.id for m in store.add("alice", texts=[words(2, f"m{i}") for i in range(50)])]
    sched.get("alice")
    sched.run_pending()
    assert len(sched.heat.stats("alice")) == 50
    statements: list[str] = []
    sched.heat._db.set_trace_callback(statements.append)
    assert store.delete_user("alice") == 50
    assert forgets == [("alice", tuple(ids))]  # one cascade over every deleted memory
    assert sched.heat.stats("alice") == {}
    heat_writes = [s for s in statements if s.startswith(("DELETE", "INSERT"))]
    assert statements.count("BEGIN") == 1 and len(heat_writes) == 1, statements
    sched.stop()


def test_access_events_coalesce_per_user_and_every_one_adds_heat(env):  # noqa: F811
    clock, store, builder, make = env
    sched = make()
    a, b = (m.id for m in store.add("alice", texts=["cat named Miso", "lives in Lisbon"]))
    sched.run_pending()
    for _ in range(50):
        sched.record_access(AccessEvent("alice", (a,), (a,), clock.t))
        sched.queue.put(Task("refresh", "alice"))
        clock.t += 1
    sched.record_access(AccessEvent("bob", (), (), clock.t))
    assert len(sched.queue) == 2  # one entry per user, whatever the number of turns
    refreshed: list[str] = []
    real = sched.worker.refresh
    sched.worker.refresh = lambda user_id, **kw: refreshed.append(user_id) or real(user_id, **kw)
    assert sched.run_pending() == 2
    assert refreshed == ["alice", "bob"]
    assert sched.heat.stats("alice")[a].hits == 50 and sched.heat.stats("alice")[a].uses == 50


def test_in_process_queue_is_bounded_and_counts_what_it_drops(env):  # noqa: F811
    clock, store, builder, make = env
    sched = make(max_queued_tasks=100)
    for i in range(1000):  # unknown users' first reads
        assert sched.get(f"user-{i}").block is None
    assert len(sched.queue) == 100 and sched.stats().dropped_tasks == 900
    sched.queue.put(Task("refresh", "user-0"))  # merges into user-0's queued entry: never dropped
    assert len(sched.queue) == 100 and sched.stats().dropped_tasks == 900
    sched.record_access(AccessEvent("user-0", (), (), clock.t))  # would be a new entry: dropped, counted
    assert len(sched.queue) == 100 and sched.stats().dropped_tasks == 901
    queue = InProcessQueue(max_tasks=10, max_events_per_user=3)
    for i in range(5):
        queue.put(Task("access", "u", AccessEvent("u", (f"m{i}",), (), float(i))))
    task = queue.get(timeout_s=0)
    assert [e.retrieved_ids for e in task.payload] == [("m2",), ("m3",), ("m4",)]  # the oldest dropped
    assert queue.dropped == 2 and len(queue) == 1  # taken, not run yet: still counted (a flush waits on it)
    queue.ack(task)
    assert len(queue) == 0


def test_an_access_only_refresh_does_not_reread_every_memory(env):  # noqa: F811
    clock, store, builder, make = env
    sched = make()
    ids = [m.id for m in store.add("alice", texts=[words(2, f"m{i}") for i in range(30)])]
    sched.get("alice")
    sched.run_pending()
    pages: list[str] = []
    real = store.list
    store.list = lambda user_id, **kw: pages.append(user_id) or real(user_id, **kw)
    for _ in range(5):
        sched.record_access(AccessEvent("alice", (ids[0],), (ids[0],), clock.t))
        sched.run_pending()
    assert pages == []  # the store's generation did not move: the list read at it is reused
    store.delete("alice", ids[1])
    sched.run_pending()
    assert pages == ["alice"]
    assert ids[1] not in sched.get("alice").block.memory_ids


def test_reading_a_plan_never_queues_a_build(env):  # noqa: F811
    clock, store, builder, make = env
    store.add("alice", texts=["cat named Miso", "lives in Lisbon"])  # before the scheduler listens
    sched = make()
    for _ in range(3):
        assert sched.peek("alice").block is None and sched.peek("nobody").block is None
    assert len(sched.queue) == 0 and sched.run_pending() == 0 and builder.builds == []
    sched.get("alice")  # a chat's read asks for the plan
    sched.run_pending()
    assert len(builder.builds) == 1 and sched.peek("alice") == sched.get("alice")


class CountingAdapters:
    """An ActiveAdapters stand-in that counts the worker's checks (`get`: stat + hash) and the reads."""

    def __init__(self):
        self.gets = self.peeks = 0
        self.moved = False  # the pointer moved since the last check (another process activated a version)

    def get(self, user_id):
        self.gets += 1
        self.moved = False
        return None

    def peek(self, user_id):
        self.peeks += 1
        return AdapterPeek(None, not self.moved)

    def drop_covering(self, user_id, memory_ids, reason):
        return False

    def erase_stale(self, user_id, memory_ids, reason):
        return []


def test_get_is_an_in_memory_read_the_worker_does_the_checks(env):  # noqa: F811
    clock, store, builder, _ = env
    asked: list[str] = []
    builder.has_block = lambda item_id: asked.append(item_id) or True  # the KV store's lock in production
    adapters = CountingAdapters()
    sched = _scheduler(store, builder, clock, adapters=adapters)
    store.add("alice", texts=["cat named Miso", "lives in Lisbon"])
    sched.get("alice")
    sched.run_pending()
    asked.clear()
    adapters.gets = 0
    for _ in range(100):
        assert sched.get("alice").block is not None
    assert (asked, adapters.gets) == ([], 0)  # no block-store call, no adapter check (no hash) on a read
    assert sched.poll_adapters(force=True) == [] and adapters.gets == 0  # nothing moved: not even checked
    adapters.moved = True
    assert sched.get("alice").block is None and adapters.gets == 0  # unchecked: text, and a refresh asked
    sched.run_pending()  # the worker checks the pointer (ActiveAdapters.get: hashes a new version) ...
    assert adapters.gets >= 1 and sched.get("alice").block is not None  # ... and the block is served again


def _save_adapter_files(directory):
    """Stand-in peft files: the registry hashes them, nothing here loads them."""
    from kvmem.adapters.manifest import CONFIG_FILE, WEIGHTS_FILE

    (directory / WEIGHTS_FILE).write_bytes(b"lora weights")
    (directory / CONFIG_FILE).write_text("{}")


def _scheduler(store, builder, clock, **kwargs) -> Scheduler:
    """A scheduler whose tasks run by run_pending (`kwargs`: Scheduler's, e.g. adapters, heat_path)."""
    sched = Scheduler(
        SchedulerConfig(half_life_s=100.0, recency_prior=1.0),
        store,
        builder,
        lambda text: len(text.split()),
        clock=clock,
        **kwargs,
    )
    sched.start(thread=False)
    return sched


def _with_adapters(store, builder, clock, registry) -> Scheduler:
    """A scheduler serving `registry`'s adapters (base fingerprint "fp")."""
    from kvmem.adapters import ActiveAdapters

    return _scheduler(store, builder, clock, adapters=ActiveAdapters(registry, lambda: "fp"))


def test_a_plan_read_does_not_hide_a_new_adapter_version_from_the_worker(env, tmp_path):  # noqa: F811
    """The regression behind test_vllm_lora's served-adapter test: a version activated on disk behind a running
    server, then the plan read (as a client polls `GET /v1/memories/plan`) before the worker's poll. The read's
    fresh check used to record the new pointer stamp, so `poll_adapters` found nothing moved and the block was
    never rebuilt under the adapter (the plan showed the adapter, with no block, for good)."""
    from kvmem.adapters import AdapterRegistry, FactRef, text_sha

    clock, store, builder, _ = env
    builder.builds_under_adapter = True  # as the vLLM and transformers backends
    builder.build_block = lambda user_id, texts, memory_ids, adapter_id=None: (
        builder.builds.append((user_id, tuple(memory_ids), adapter_id))
        or Built(f"item-{len(builder.builds)}", sum(len(t.split()) for t in texts), 100 * len(texts))
    )
    registry = AdapterRegistry(tmp_path / "adapters")
    sched = _with_adapters(store, builder, clock, registry)
    cat, lisbon = (m.id for m in store.add("alice", texts=["cat named Miso", "lives in Lisbon"]))
    sched.run_pending()
    assert [(u, set(ids), a) for u, ids, a in builder.builds] == [("alice", {cat, lisbon}, None)]
    m = registry.write(
        "alice",
        _save_adapter_files,
        base_fingerprint="fp",
        facts=[FactRef(cat, 1, text_sha("cat named Miso"))],
        seed=0,
        passed=True,
    )
    registry.activate("alice", m.version, "fp")
    looked = sched.peek("alice")  # the plan route: sees the new version now, never builds
    assert looked.adapter.name == m.name and looked.block is None
    assert sched.poll_adapters(force=True) == ["alice"]  # the worker still notices the move
    sched.run_pending()
    assert builder.builds[-1] == ("alice", (lisbon,), m.adapter_id)
    plan = sched.peek("alice")
    assert (plan.adapter.name, plan.block.adapter, plan.block.memory_ids) == (m.name, m.name, (lisbon,))


def test_a_task_taken_but_not_run_yet_keeps_the_scheduler_busy(env):  # noqa: F811
    """`flush` returned while the worker had taken a task from the queue and not yet started it (the queue was
    empty, `in_task` not set yet): a test's next read saw no block (Redis widened that window under load)."""
    clock, store, builder, make = env
    sched = make()
    store.add("alice", texts=["my cat is Tofu"])
    sched.get("alice")
    task = sched.queue.get(timeout_s=0)  # as the worker thread does, just before `handle`
    assert task is not None and not sched.worker.in_task
    assert not sched.idle()  # idle before the fix: the entry had left the queue
    sched.worker.handle(task)  # runs and acks it
    assert sched.idle() and sched.get("alice").block is not None


def test_a_users_prewarms_merge_while_one_waits():
    """A prewarm asked again (each session start, or a client re-asking while a build runs) while the user's
    first one still waits is one entry: the one that runs warms the block all the same. Other users' stay apart,
    and once the first was taken a new one queues again."""
    queue = InProcessQueue()
    for user in ("alice", "bob", "alice", "alice"):
        queue.put(Task("prewarm", user))
    assert len(queue) == 2
    first = queue.get(timeout_s=0)
    assert (first.kind, first.user_id) == ("prewarm", "alice")
    queue.put(Task("prewarm", "alice"))  # alice's was taken: a new one queues
    assert [queue.get(timeout_s=0).user_id for _ in range(2)] == ["bob", "alice"]
    assert queue.get(timeout_s=0) is None


def test_a_delete_withdraws_the_block_even_when_the_adapter_registry_cannot_be_written(tmp_path):
    """The adapter half of the cascade ran first, unguarded: a full disk under the registry skipped the KV half,
    so the deleted memory stayed in the served block and no stored item holding it was forgotten."""
    import pytest

    from kvmem.adapters import AdapterRegistry, FactRef, text_sha
    from kvmem.text import HashEmbedder, MemoryStore
    from kvmem.text.errors import SubscriberError
    from tests.scheduler.test_scheduler import Clock, FakeBuilder

    clock, builder = Clock(), FakeBuilder()
    forgotten = []
    builder.forget = lambda user_id, ids: forgotten.append((user_id, list(ids))) or []
    store = MemoryStore(tmp_path / "m.sqlite", embedder=HashEmbedder(), clock=clock.dt)
    registry = AdapterRegistry(tmp_path / "adapters")
    sched = _with_adapters(store, builder, clock, registry)
    try:
        cat, lisbon = store.add("alice", texts=["cat named Miso", "lives in Lisbon"])
        sched.get("alice")
        sched.run_pending()
        assert set(sched.get("alice").block.memory_ids) == {cat.id, lisbon.id}
        facts = [FactRef(cat.id, 1, text_sha(cat.text))]
        registry.write("alice", _save_adapter_files, base_fingerprint="fp", facts=facts, seed=0, passed=False)
        registry._set_pointer = _raise  # the registry's pointer write fails (a full disk)
        with pytest.raises(SubscriberError):
            store.delete("alice", cat.id)  # committed; the HTTP route answers 200 with a warning
        assert sched.get("alice").block is None  # withdrawn before the delete returned
        assert forgotten == [("alice", [cat.id])]
        sched.run_pending()
        assert sched.get("alice").block.memory_ids == (lisbon.id,)
    finally:
        sched.stop()
        store.close()
