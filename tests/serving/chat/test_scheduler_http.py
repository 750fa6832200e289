"""The scheduler as `create_app` runs it, worker thread included (fake backend: plumbing): blocks built off the
request path, served from KV, dropped before a DELETE returns, visible in the plan route and /metrics."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from kvmem.text import HashEmbedder, MemoryStore
from scheduler import Scheduler, SchedulerConfig
from scheduler.wiring import make_scheduler
from serving.backends.fake import FakeBackend
from serving.config import ServingConfig
from serving.http.app import create_app
from serving.http.protocol import plan_dict
from tests.scheduler.test_redis_queue import redis_url  # noqa: F401 - the live redis-server fixture


def test_scheduler_plans_through_http(tmp_path):
    backend = FakeBackend(reply="ok")
    store = MemoryStore(tmp_path / "m.sqlite", embedder=HashEmbedder())
    config = ServingConfig(
        data_dir=tmp_path, backend="fake", auth=False, store_turns=False, block_token_budget=4096
    )
    scheduler = make_scheduler(config, store, backend)
    scheduler.start()
    app = create_app(config, backend=backend, store=store, scheduler=scheduler)
    with TestClient(app) as client:
        ids = [
            m["id"]
            for m in client.post(
                "/v1/memories",
                json={
                    "user_id": "alice",
                    "messages": [
                        {"role": "user", "content": "my cat is Tofu"},
                        {"role": "user", "content": "I live in Porto"},
                    ],
                },
            ).json()["memories"]
        ]
        scheduler.flush()
        plan = client.get("/v1/memories/plan", params={"user_id": "alice"}).json()
        assert plan["block"]["tier"] == "kv" and sorted(plan["block"]["memory_ids"]) == sorted(ids)
        builds = plan["scheduler"][
            "builds"
        ]  # one, or more when the worker saw the add's rows apart (busy machine)
        out = client.post(
            "/v1/chat/completions",
            json={"model": "default", "user": "alice", "messages": [{"role": "user", "content": "cat?"}]},
        ).json()
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == plan["block"]["tokens"] > 0
        assert {m["tier"] for m in out["memory"]["used"]} == {"kv"}
        # the plan carried the block's ids, so the request did not tokenize the block again
        assert backend.block_ids_given == 1
        assert (
            scheduler.get("alice").block.token_ids
            == backend.requests[-1].prompt.ids[: plan["block"]["tokens"]]
        )
        assert client.delete(f"/v1/memories/{ids[0]}", params={"user_id": "alice"}).json() == {"deleted": 1}
        # stopped serving before the DELETE returned (no flush in between; the worker may already have rebuilt)
        block = client.get("/v1/memories/plan", params={"user_id": "alice"}).json()["block"]
        assert block is None or ids[0] not in block["memory_ids"]  # null: no block until the rebuild
        scheduler.flush()
        plan = client.get("/v1/memories/plan", params={"user_id": "alice"}).json()
        assert plan["block"]["memory_ids"] == [ids[1]]
        # rebuilt (more than once when a build raced the delete's rows and was found stale); /metrics agrees
        rebuilt = plan["scheduler"]["builds"]
        assert plan["scheduler"]["num_blocks"] == 1 and rebuilt > builds >= 1
        metrics = client.get("/metrics").text
        assert "kvmem_scheduler_blocks 1" in metrics and f"kvmem_scheduler_builds_total {rebuilt}" in metrics
        assert plan_dict(scheduler.get("bob"))["block"] is None  # API.md: null when there is no block
    scheduler.stop()
    store.close()


def test_create_app_runs_the_scheduler_and_stops_it_at_shutdown(tmp_path):
    backend = FakeBackend(reply="ok")
    store = MemoryStore(tmp_path / "m.sqlite", embedder=HashEmbedder())
    config = ServingConfig(
        data_dir=tmp_path, backend="fake", auth=False, store_turns=False, block_token_budget=20
    )
    with TestClient(create_app(config, backend=backend, store=store)) as client:
        scheduler = client.app.state.scheduler
        assert isinstance(scheduler, Scheduler) and scheduler.config == SchedulerConfig(user_block_tokens=20)
        thread = scheduler._thread
        assert thread is not None and thread.is_alive()
        [memory] = store.add("alice", texts=["my cat is Tofu"])
        scheduler.flush()
        assert scheduler.get("alice").block.memory_ids == (memory.id,)
    assert not thread.is_alive()  # stopped by the app that built it
    store.close()


@pytest.mark.redis
def test_scheduler_redis_url_reaches_the_scheduler(request, tmp_path):
    from scheduler.queue import RedisStreamsQueue

    url, _ = request.getfixturevalue("redis_url")  # a live redis-server on loopback
    backend = FakeBackend(reply="ok")
    store = MemoryStore(tmp_path / "m.sqlite", embedder=HashEmbedder())
    config = ServingConfig(
        data_dir=tmp_path, backend="fake", auth=False, store_turns=False, scheduler_redis_url=url
    )
    with TestClient(create_app(config, backend=backend, store=store)) as client:
        scheduler = client.app.state.scheduler
        assert isinstance(scheduler.queue, RedisStreamsQueue)
        [memory] = store.add("alice", texts=["my cat is Tofu"])
        scheduler.flush()
        assert client.get("/v1/memories/plan", params={"user_id": "alice"}).json()["block"]["memory_ids"] == [
            memory.id
        ]
        assert scheduler.queue.pending() == 0
    store.close()


def test_a_redis_unreachable_at_start_stops_the_server_naming_it(tmp_path, capsys):
    import socket

    from kvmem.errors import DependencyUnavailable
    from serving.ops.cli import main

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"redis://:secret@127.0.0.1:{port}/0"
    config = ServingConfig(data_dir=tmp_path, backend="fake", auth=False, scheduler_redis_url=url)
    with pytest.raises(DependencyUnavailable, match=rf"^redis at 127\.0\.0\.1:{port} is unreachable: "):
        create_app(config)
    args = [
        "serve",
        "--backend",
        "fake",
        "--no-auth",
        "--data-dir",
        str(tmp_path),
        "--scheduler-redis-url",
        url,
    ]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"kvmem: error: DependencyUnavailable: redis at 127.0.0.1:{port} is unreachable: ")
    assert "secret" not in err and err.count("\n") == 1


def test_tasks_the_bounded_queue_dropped_are_in_metrics(tmp_path):
    backend = FakeBackend(reply="ok")
    store = MemoryStore(tmp_path / "m.sqlite", embedder=HashEmbedder())
    config = ServingConfig(data_dir=tmp_path, backend="fake", auth=False, store_turns=False)
    scheduler = make_scheduler(
        config, store, backend, scheduler_config=SchedulerConfig(max_queued_tasks=1)
    )  # not started: nothing drains the queue
    app = create_app(config, backend=backend, store=store, scheduler=scheduler)
    with TestClient(app) as client:
        for user in ("u1", "u2", "u3"):
            scheduler.get(user)  # an unknown user's first read queues their refresh
        text = client.get("/metrics").text
        assert "kvmem_scheduler_dropped_tasks 2" in text and "kvmem_scheduler_queue_depth 1" in text
    scheduler.stop()


def test_memories_stored_before_the_start_get_a_block_on_prewarm_not_on_a_plan_read(tmp_path) -> None:
    """After a restart a user's memories are there but nothing changed: a plan read never builds (a read), a
    prewarm (or the user's first chat) does."""
    from tests.serving.conftest import ALICE, make_stack

    with MemoryStore(tmp_path / "memories.sqlite") as before:
        before.add("alice", texts=["I live in Lisbon.", "My dog is called Miso."])
    stack = make_stack(tmp_path)
    try:
        with TestClient(stack.app) as client:
            plan = client.get("/v1/memories/plan", params={"user_id": "alice"}, headers=ALICE).json()
            stack.scheduler.flush()
            assert plan["block"] is None and stack.scheduler.stats().builds == 0
            r = client.post("/v1/memories/plan/prewarm", json={"user_id": "alice"}, headers=ALICE)
            assert (r.status_code, r.json()) == (202, {"queued": True})
            stack.scheduler.flush()
            plan = client.get("/v1/memories/plan", params={"user_id": "alice"}, headers=ALICE).json()
            assert len(plan["block"]["memory_ids"]) == 2
            r = client.post("/v1/memories/plan/prewarm", json={"user_id": "bob"}, headers=ALICE)
            assert r.status_code == 403  # alice's key may not act for bob
    finally:
        stack.scheduler.stop()
