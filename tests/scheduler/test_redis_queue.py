"""The Redis Streams queue against a real redis-server on loopback (installed with apt if missing, started
and stopped here): at-least-once across a worker that dies mid-task, JSON round trip, fallback when down."""

from __future__ import annotations

import logging
import socket
import subprocess
import time

import pytest

from scheduler.queue import InProcessQueue, RedisStreamsQueue, Task, make_queue
from scheduler.service import AccessEvent
from tests import debian

pytestmark = pytest.mark.redis


def _ensure_redis_server() -> str:
    return debian.ensure("redis-server", "redis-server")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture()
def redis_url(tmp_path):
    binary = _ensure_redis_server()
    port = _free_port()
    proc = subprocess.Popen(
        [
            binary,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(tmp_path),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    try:
        import redis

        client = redis.Redis.from_url(url)
        for _ in range(200):  # bounded: 10 s
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        yield url, proc
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_task_left_pending_by_a_dead_worker_is_reclaimed_and_acked_once(redis_url):
    url, _ = redis_url
    first = RedisStreamsQueue(url, consumer="w1", min_idle_ms=100)
    event = AccessEvent("alice", ("m1", "m2"), ("m1",), 12.5, "s1")
    first.put(Task("access", "alice", event))
    taken = first.get(timeout_s=1)
    assert (taken.kind, taken.user_id, taken.payload) == ("access", "alice", event)  # JSON round trip
    # w1 dies here without acking; w2 finds nothing new but reclaims the stale pending entry
    second = RedisStreamsQueue(url, consumer="w2", min_idle_ms=100)
    time.sleep(0.2)
    again = second.get(timeout_s=1)
    assert again.entry_id == taken.entry_id and again.payload == event
    assert second.pending() == 1
    second.ack(again)
    assert second.pending() == 0
    assert second.get(timeout_s=0.2) is None


def test_a_done_tasks_entry_leaves_the_stream(redis_url):
    """Acked entries stayed in the stream (about 190 bytes a task, one or more a chat turn, for its life)."""
    url, _ = redis_url
    queue = RedisStreamsQueue(url, consumer="w1")
    for i in range(50):
        queue.put(Task("refresh", f"user-{i % 7}"))
    queue.flush()
    done = []
    while (task := queue.get(timeout_s=0.2)) is not None:
        queue.ack(task)
        done.append(task.user_id)
    assert len(done) == 50 and done[:8] == [f"user-{i % 7}" for i in range(8)]
    assert (queue.client.xlen(queue.stream), queue.pending(), len(queue)) == (0, 0, 0)
    queue.put(Task("refresh", "alice"))  # the group reads on after the deletions
    queue.flush()
    assert len(queue) == 1 and queue.get(timeout_s=1).user_id == "alice"
    queue.close()


def test_unreachable_redis_falls_back_to_in_process(caplog):
    with caplog.at_level(logging.WARNING):
        queue = make_queue(f"redis://127.0.0.1:{_free_port()}/0")
    assert isinstance(queue, InProcessQueue)
    assert "using the in-process queue" in caplog.text


def test_redis_going_down_mid_run_keeps_tasks_in_process(redis_url, caplog):
    url, proc = redis_url
    queue = RedisStreamsQueue(url, consumer="w1", min_idle_ms=100)
    proc.terminate()
    proc.wait(timeout=10)
    with caplog.at_level(logging.WARNING):
        queue.put(Task("refresh", "bob"))
        got = queue.get(timeout_s=0.1)
    assert (got.kind, got.user_id, got.entry_id) == ("refresh", "bob", None)
    assert "redis unreachable" in caplog.text


def test_scheduler_runs_its_tasks_through_redis(redis_url, tmp_path):
    from kvmem.text import HashEmbedder, MemoryStore
    from scheduler import Scheduler, SchedulerConfig
    from tests.scheduler.test_scheduler import FakeBuilder

    url, _ = redis_url
    store = MemoryStore(tmp_path / "m.sqlite", embedder=HashEmbedder())
    builder = FakeBuilder()
    sched = Scheduler(SchedulerConfig(), store, builder, lambda t: len(t.split()), redis_url=url)
    assert isinstance(sched.queue, RedisStreamsQueue)
    sched.start()
    try:
        ids = [m.id for m in store.add("alice", texts=["cat named Miso", "lives in Lisbon"])]
        for _ in range(200):  # bounded: 10 s
            if sched.get("alice").block is not None and sched.idle():
                break
            time.sleep(0.05)
        assert set(sched.get("alice").block.memory_ids) == set(ids)
        assert sched.queue.pending() == 0  # every task acknowledged after it ran
    finally:
        sched.stop()
        store.close()


def test_put_never_waits_on_a_frozen_redis(redis_url):
    """The request path enqueues: with redis-server stopped (SIGSTOP) put still returns at once, the tasks wait
    in the outbox, and once Redis answers again they reach the stream in order."""
    import signal

    url, proc = redis_url
    queue = RedisStreamsQueue(url, consumer="w1", min_idle_ms=100)
    proc.send_signal(signal.SIGSTOP)
    try:
        for user in ("a", "b", "c"):
            queue.put(Task("refresh", user))
        assert [t.user_id for t in queue._outbox][-2:] == ["b", "c"]  # the sender is stuck on at most one
    finally:
        proc.send_signal(signal.SIGCONT)
    assert queue.flush(timeout_s=10)
    got = [queue.get(timeout_s=1) for _ in range(3)]
    assert [t.user_id for t in got] == ["a", "b", "c"] and all(t.entry_id for t in got)
    for t in got:
        queue.ack(t)
    assert queue.pending() == 0
    queue.close()
