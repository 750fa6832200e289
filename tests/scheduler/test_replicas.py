"""Replicas over one data dir and one Redis: a memory changed through one replica stops being served by every
replica before the call returns (the shared fence, scheduler/fence.py), fail-closed while the fence cannot be
read, and each process is its own Redis consumer. Two schedulers / two apps in this process, a real
redis-server on loopback (started by the fixture), fake backends (the fence is plumbing, not model math)."""

from __future__ import annotations

import asyncio
import os
import re
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
import pytest
from fastapi.testclient import TestClient

from kvmem.errors import DependencyUnavailable
from kvmem.text import HashEmbedder, MemoryStore
from scheduler import Scheduler, SchedulerConfig
from scheduler.queue import RedisStreamsQueue, Task
from scheduler.wiring import make_scheduler
from serving.backends.fake import FakeBackend
from serving.config import ServingConfig
from serving.http.app import create_app
from tests.scheduler.test_redis_queue import redis_url  # noqa: F401 - the live redis-server fixture
from tests.scheduler.test_scheduler import FakeBuilder

NO_BLOCK = None  # the plan route's block when there is none (API.md)


class SharedFence:
    """The Redis counter's semantics in memory (for the scheduler-level race test); `down` makes it unreadable."""

    def __init__(self) -> None:
        self.gen: dict[str, int] = {}
        self.down = False

    def bump(self, user_id: str) -> int:
        self.gen[user_id] = self.gen.get(user_id, 0) + 1
        return self.gen[user_id]

    def read(self, user_id: str) -> int | None:
        return None if self.down else self.gen.get(user_id, 0)

    def retry_pending(self) -> None:
        """Nothing is ever pending here."""

    def ping(self) -> None:
        if self.down:
            raise DependencyUnavailable("redis", "shared-fence", "down")


def scheduler(store: MemoryStore, builder: FakeBuilder, fence: SharedFence) -> Scheduler:
    sched = Scheduler(SchedulerConfig(), store, builder, lambda text: len(text.split()), fence=fence)
    sched._unsubscribe = store.subscribe(sched.on_change)  # events without the worker thread
    return sched


def test_a_build_racing_a_change_on_another_replica_is_never_served(tmp_path):
    """B read alice's memories, then A deleted one and returned; B's block, built from the old memories and
    published after the delete, must not be served: its fence stamp predates A's bump."""
    fence = SharedFence()
    store_a = MemoryStore(tmp_path / "m.sqlite", embedder=HashEmbedder())
    store_b = MemoryStore(tmp_path / "m.sqlite", embedder=HashEmbedder())  # another process's connection
    a, b = scheduler(store_a, FakeBuilder(), fence), scheduler(store_b, FakeBuilder(), fence)
    ids = [m.id for m in store_a.add("alice", texts=["cat named Miso", "lives in Lisbon"])]
    b.builder.gate = threading.Event()
    building = threading.Thread(target=b.worker.refresh, args=("alice",))
    building.start()
    assert b.builder.entered.wait(10)  # B is building from both memories
    assert store_a.delete("alice", ids[0]) == 1  # through A: B's store never hears of it
    assert fence.gen == {"alice": 1}
    b.builder.gate.set()
    building.join(10)
    stale = b.plans.get("alice").block
    assert set(stale.memory_ids) == set(ids)  # published, stamped before the bump ...
    assert b.get("alice").block is None  # ... so never served
    assert b.plans.get("alice").block is None  # and retracted for every reader, a rebuild enqueued
    assert b.builder.dropped == [stale.item_id]  # and deleted: it holds the memory A deleted
    assert b.run_pending() == 1
    assert b.get("alice").block.memory_ids == (ids[1],)

    fence.down = True  # unreadable: no block is served, and nothing is retracted (it is transient)
    assert b.get("alice").block is None and b.plans.get("alice").block is not None
    fence.down = False
    assert b.get("alice").block.memory_ids == (ids[1],)
    for sched in (a, b):
        sched.stop()
    store_a.close()
    store_b.close()


def test_a_stale_block_built_after_the_other_replicas_cascade_is_deleted_from_the_shared_data_dir(
    tmp_path, tiny_model_dir
):
    """Issue 42 item 15, over the real KV store: B's build of alice's block writes its file after A's delete
    ran its cascade (which found no file to delete). B's next read finds the block stale (the fence moved):
    it is retracted and its file deleted from the shared data dir; the rebuild holds only what is left."""
    from kvmem.datadir import DataDir
    from tests.serving.kvstack import load_backend

    fence = SharedFence()
    store_a = MemoryStore(tmp_path / "m.sqlite", embedder=HashEmbedder())
    store_b = MemoryStore(tmp_path / "m.sqlite", embedder=HashEmbedder())
    a_backend, b_backend = (load_backend(tiny_model_dir, tmp_path) for _ in range(2))
    config = ServingConfig(data_dir=tmp_path, backend="transformers", auth=False)
    a = make_scheduler(config, store_a, a_backend, fence=fence)
    b = make_scheduler(config, store_b, b_backend, fence=fence)
    for sched in (a, b):
        sched.start(thread=False)
    kv_dir = DataDir.at(tmp_path).kv_dir
    ids = [m.id for m in store_a.add("alice", texts=["my cat is named Miso", "I live in Lisbon"])]
    gate, entered = threading.Event(), threading.Event()
    real_build = b.builder.build_block

    def gated_build(*args, **kwargs):
        entered.set()
        assert gate.wait(30)
        return real_build(*args, **kwargs)

    b.builder.build_block = gated_build
    try:
        building = threading.Thread(target=b.worker.refresh, args=("alice",))
        building.start()
        assert entered.wait(30)  # B read both memories and is about to build
        assert store_a.delete("alice", ids[0]) == 1  # A's cascade: nothing of B's on disk yet
        gate.set()
        building.join(60)
        stale = b.plans.get("alice").block
        assert set(stale.memory_ids) == set(ids)
        assert any(p.name.startswith(stale.item_id) for p in kv_dir.iterdir())  # its file, with Miso's K/V
        assert b.get("alice").block is None
        assert b.plans.get("alice").block is None
        assert not any(p.name.startswith(stale.item_id) for p in kv_dir.iterdir())  # deleted
        assert not b_backend.has_block(stale.item_id)
        b.run_pending()
        assert b.get("alice").block.memory_ids == (ids[1],)
    finally:
        gate.set()
        for sched in (a, b):
            sched.stop()
        for backend in (a_backend, b_backend):
            asyncio.run(backend.aclose())
        store_a.close()
        store_b.close()


# -- two apps over one data dir and a real Redis ------------------------------------------------------------


@dataclass
class Replica:
    client: TestClient
    plans: Scheduler
    backend: FakeBackend

    def plan(self, user: str) -> dict:
        r = self.client.get("/v1/memories/plan", params={"user_id": user})
        assert r.status_code == 200, r.text
        return r.json()["block"]

    def chat(self, user: str) -> dict:
        body = {"model": "default", "user": user, "messages": [{"role": "user", "content": "cat?"}]}
        r = self.client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()


@contextmanager
def replica(data_dir, url: str) -> Iterator[Replica]:
    backend = FakeBackend(reply="ok")
    store = MemoryStore(data_dir / "memories.sqlite", embedder=HashEmbedder())
    config = ServingConfig(
        data_dir=data_dir,
        backend="fake",
        auth=False,
        store_turns=False,
        block_token_budget=4096,
        scheduler_redis_url=url,
    )
    plans = make_scheduler(config, store, backend)
    plans.start()
    try:
        with TestClient(create_app(config, backend=backend, store=store, scheduler=plans)) as client:
            yield Replica(client, plans, backend)
    finally:
        plans.stop()
        store.close()


def add(r: Replica, user: str, text: str) -> str:
    resp = r.client.post("/v1/memories", json={"user_id": user, "text": text})
    assert resp.status_code == 201, resp.text
    return resp.json()["memories"][0]["id"]


@pytest.mark.redis
@pytest.mark.parametrize("how", ["delete", "patch"])
def test_a_change_through_replica_a_stops_replica_b_serving_it_before_it_returns(request, tmp_path, how):
    url, _ = request.getfixturevalue("redis_url")
    with replica(tmp_path, url) as a, replica(tmp_path, url) as b:
        ids = [add(a, "alice", "my cat is Tofu"), add(a, "alice", "I live in Porto")]
        b.plans.worker.refresh("alice")  # alice is sticky to B: B holds her block
        block = b.plan("alice")
        assert block["tier"] == "kv" and sorted(block["memory_ids"]) == sorted(ids)
        out = b.chat("alice")
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == block["tokens"]
        assert b.backend.requests[-1].block_item_id == block["item_id"]
        b.backend.set_ready(
            False
        )  # B's worker builds nothing now: B's plan can change only through the fence

        if how == "delete":
            r = a.client.delete(f"/v1/memories/{ids[0]}", params={"user_id": "alice"})
        else:
            r = a.client.patch(f"/v1/memories/{ids[0]}", json={"user_id": "alice", "text": "my cat is Rex"})
        assert r.status_code == 200, r.text
        assert b.plan("alice") == NO_BLOCK  # A's call has returned: B no longer serves the block

        b.backend.set_ready(True)
        out = b.chat("alice")  # served without the old block (B may have rebuilt one from the new memories)
        assert b.backend.requests[-1].block_item_id != block["item_id"]
        if how == "delete":
            assert ids[0] not in [u["id"] for u in out["memory"]["used"]]


@pytest.mark.redis
def test_no_replica_serves_a_block_while_the_fence_is_unreadable(request, tmp_path):
    url, proc = request.getfixturevalue("redis_url")
    with replica(tmp_path, url) as a, replica(tmp_path, url) as b:
        memory = add(a, "alice", "my cat is Tofu")
        b.plans.worker.refresh("alice")
        assert b.plan("alice")["memory_ids"] == [memory]
        proc.terminate()
        proc.wait(timeout=10)
        assert b.plan("alice") == NO_BLOCK  # fail closed: B cannot know whether A changed alice's memories
        out = b.chat("alice")
        assert b.backend.requests[-1].block_item_id is None
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        # A cannot tell its peers, so it refuses the delete (503 naming Redis) and deletes nothing: a delete
        # it committed now could be served by a peer that still holds the block and can read the fence again
        r = a.client.delete(f"/v1/memories/{memory}", params={"user_id": "alice"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "dependency_unavailable", r.text
        assert re.fullmatch(r"redis at 127\.0\.0\.1:\d+ is unreachable: .+", r.json()["error"]["message"])
        assert a.client.get(f"/v1/memories/{memory}", params={"user_id": "alice"}).status_code == 200
        assert a.plans.fence.unbumped == frozenset()


@pytest.mark.redis
def test_each_queue_is_its_own_consumer_and_leaves_the_group_when_done(request):
    url, _ = request.getfixturevalue("redis_url")
    q1, q2 = RedisStreamsQueue(url), RedisStreamsQueue(url)
    pattern = rf"{re.escape(socket.gethostname())}-{os.getpid()}-[0-9a-f]{{8}}"
    assert q1.consumer != q2.consumer
    assert re.fullmatch(pattern, q1.consumer) and re.fullmatch(pattern, q2.consumer)
    q1.put(Task("refresh", "a"))
    q1.put(Task("refresh", "b"))
    assert q1.flush()
    t1, t2 = q1.get(timeout_s=1), q2.get(timeout_s=1)
    assert (t1.user_id, t2.user_id) == ("a", "b")

    def consumers() -> dict[str, int]:
        info = q1.client.xinfo_consumers(q1.stream, q1.group)
        return {c["name"].decode(): c["pending"] for c in info}

    assert consumers() == {q1.consumer: 1, q2.consumer: 1}
    q1.ack(t1)
    q1.close()
    q2.close()  # q2's entry is still pending: q2 stays, so XAUTOCLAIM can hand the entry to a live worker
    assert consumers() == {q2.consumer: 1}


class SlowFence(SharedFence):
    """A fence whose armed read waits (up to `wait_s`) until the test releases it: a Redis that answers slowly."""

    def __init__(self, wait_s: float = 3.0) -> None:
        super().__init__()
        self.wait_s = wait_s
        self.armed = False
        self.reading = threading.Event()
        self.release = threading.Event()
        self.waited_out = False  # the armed read gave up: nothing released it within wait_s

    def read(self, user_id: str) -> int | None:
        if self.armed:
            self.armed = False
            self.reading.set()
            self.waited_out = not self.release.wait(self.wait_s)
        return super().read(user_id)


@pytest.mark.parametrize("route", ["chat", "plan"])
def test_a_slow_fence_read_never_blocks_the_event_loop(tmp_path, route):
    """Issue 27 item 4: a chat's fence read (Scheduler.get, on every request with replicas) or a plan read's
    (Scheduler.peek) waits on Redis; the server's event loop answers other requests meanwhile, and the request
    is then answered with the block. The read ran on the loop before: /health waited out the whole read."""
    from tests.serving.conftest import live_server

    fence = SlowFence()
    backend = FakeBackend(reply="ok")
    store = MemoryStore(tmp_path / "memories.sqlite", embedder=HashEmbedder())
    config = ServingConfig(data_dir=tmp_path, backend="fake", auth=False, store_turns=False)
    plans = make_scheduler(config, store, backend, fence=fence)
    plans.start(thread=False)
    memory = store.add("alice", texts=["my cat is Tofu"])[0].id
    plans.get("alice")
    plans.flush()
    block = plans.get("alice").block
    assert block.memory_ids == (memory,)
    body = {"model": "default", "user": "alice", "messages": [{"role": "user", "content": "cat?"}]}
    try:
        with live_server(create_app(config, backend=backend, store=store, scheduler=plans)) as url:
            answers: list[httpx.Response] = []

            def ask() -> None:
                if route == "chat":
                    answers.append(httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30))
                else:
                    answers.append(
                        httpx.get(f"{url}/v1/memories/plan", params={"user_id": "alice"}, timeout=30)
                    )

            fence.armed = True
            asking = threading.Thread(target=ask)
            asking.start()
            try:
                assert fence.reading.wait(10)  # the request is inside the fence read
                health = httpx.get(f"{url}/health", timeout=30)
                assert not fence.release.is_set() and not fence.waited_out  # answered while the read waited
            finally:
                fence.release.set()
                asking.join(30)
            assert health.status_code == 200
            assert not fence.waited_out
            assert [a.status_code for a in answers] == [200]
            if route == "chat":  # the fence still read the same: the block is served
                assert backend.requests[-1].block_item_id == block.item_id
            else:
                assert answers[0].json()["block"]["item_id"] == block.item_id
    finally:
        plans.stop()
        store.close()
