"""Plans stay true to the KV store: a block the store evicts or finds corrupt leaves the user's plan (the plan
route stops saying kv), is rebuilt through the scheduler, and the next chat is served from KV again; a
request that fell back to prefill reports its block (ChatService -> report_unservable). Real scheduler; the
tiny llama behind the transformers backend where the store matters, the fake backend for the report path."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from kvmem.kv.io import item_paths
from kvmem.text import HashEmbedder, MemoryStore
from scheduler.wiring import make_scheduler
from serving.backends.fake import FakeBackend
from serving.config import ServingConfig
from serving.http.app import create_app
from tests.serving.kvstack import load_backend, served

NO_BLOCK = None  # the plan route's block when there is none (API.md)


def cached(out: dict) -> int:
    return out["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_an_evicted_block_leaves_the_plan_and_is_rebuilt_when_its_user_asks(tmp_path, tiny_model_dir):
    # a disk budget of 1 byte: the store keeps only the item it stored or served last
    backend = load_backend(tiny_model_dir, tmp_path, disk_kv_bytes=1)
    with served(tmp_path, backend) as s:
        lisbon = s.add("alice", "I live in Lisbon.")
        s.plans.flush()
        first = s.plan("alice")
        assert (first["tier"], first["memory_ids"]) == ("kv", [lisbon])
        violin = s.add("bob", "I play the violin.")
        s.plans.flush()
        bob = s.plan("bob")
        assert (bob["tier"], bob["memory_ids"]) == ("kv", [violin])
        assert backend.store.item_ids() == [bob["item_id"]]  # bob's block evicted alice's from disk
        assert s.plan("alice") == NO_BLOCK  # the plan route does not claim an evicted block
        s.plans.flush()
        assert s.plan("alice") == NO_BLOCK  # nor rebuilds it: a read never triggers a build
        s.chat("alice")  # a chat asks for alice's plan: her rebuild is enqueued
        s.plans.flush()
        assert s.plan("alice") == first  # the same content address, built again
        assert backend.store.contains(first["item_id"])
        out = s.chat("alice")
        assert cached(out) == first["tokens"] > 0
        assert out["memory"]["used"] == [{"id": lisbon, "tier": "kv"}]
        s.plans.flush()
        # alice, bob, alice again; bob (evicted in turn) waits until he asks: no eviction ping-pong
        assert s.plans.stats().builds == 3
        assert s.plan("bob") == NO_BLOCK


def test_a_corrupt_block_falls_back_then_is_rebuilt_and_served_from_kv(tmp_path, tiny_model_dir):
    # no RAM tiers: every request reads the block's file
    backend = load_backend(tiny_model_dir, tmp_path, host_kv_bytes=0)
    with served(tmp_path, backend) as s:
        lisbon = s.add("alice", "I live in Lisbon.")
        s.plans.flush()
        block = s.plan("alice")
        assert block["tier"] == "kv"
        assert cached(s.chat("alice")) == block["tokens"] > 0
        tensor_path, _ = item_paths(backend.store.directory, block["item_id"])
        data = bytearray(tensor_path.read_bytes())
        data[-10] ^= 0x55
        tensor_path.write_bytes(bytes(data))

        backend.pool.prefix.drop_user(
            "alice"
        )  # no pages of the first chat reused (prefix reuse, issue 44 item 5)
        fell_back = s.chat("alice")
        assert cached(fell_back) == 0
        assert fell_back["memory"]["used"] == [{"id": lisbon, "tier": "text"}]
        s.plans.flush()  # the store dropped the item, the scheduler heard it and rebuilt the block
        assert s.plan("alice") == block
        assert backend.store.is_valid_on_disk(block["item_id"])
        backend.pool.prefix.drop_user("alice")
        again = s.chat("alice")
        assert cached(again) == block["tokens"]
        assert again["memory"]["used"] == [{"id": lisbon, "tier": "kv"}]
        assert s.plans.stats().builds == 2


@pytest.fixture()
def fake_stack(tmp_path):
    backend = FakeBackend(reply="ok")
    store = MemoryStore(tmp_path / "m.sqlite", embedder=HashEmbedder())
    config = ServingConfig(
        data_dir=tmp_path, backend="fake", auth=False, store_turns=False, block_token_budget=4096
    )
    plans = make_scheduler(config, store, backend)
    plans.start()
    with TestClient(create_app(config, backend=backend, store=store, scheduler=plans)) as client:
        yield client, plans, backend, store
    plans.stop()
    store.close()


def chat(client: TestClient, user: str) -> dict:
    body = {"model": "default", "user": user, "messages": [{"role": "user", "content": "cat?"}]}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def plan(client: TestClient, user: str) -> dict:
    return client.get("/v1/memories/plan", params={"user_id": user}).json()["block"]


def test_a_request_that_fell_back_has_its_block_rebuilt(fake_stack):
    client, plans, backend, store = fake_stack
    [tofu] = [m.id for m in store.add("alice", texts=["my cat is Tofu"])]
    plans.flush()
    block = plan(client, "alice")
    assert cached(chat(client, "alice")) == block["tokens"] > 0
    backend.corrupt(block["item_id"])  # the backend cannot use it, and no store told the scheduler

    fell_back = chat(client, "alice")
    assert cached(fell_back) == 0 and fell_back["memory"]["used"] == [{"id": tofu, "tier": "text"}]
    client.portal.call(client.app.state.chat.drain)  # the report runs off the event loop
    assert plans.report_unservable("alice", block["item_id"]) is False  # reported once: idempotent
    plans.flush()
    assert plan(client, "alice") == block
    assert cached(chat(client, "alice")) == block["tokens"]
    assert [u for u, _ in backend.built] == ["alice", "alice"]


def test_the_plan_route_never_reports_a_block_the_backend_no_longer_has(fake_stack):
    client, plans, backend, store = fake_stack
    store.add("alice", texts=["my cat is Tofu"])
    plans.flush()
    block = plan(client, "alice")
    backend.drop_block(block["item_id"])  # gone behind the scheduler's back
    assert plan(client, "alice") == NO_BLOCK
    plans.flush()
    assert plan(client, "alice") == NO_BLOCK  # a read never triggers a build ...
    chat(client, "alice")  # ... a chat's read does
    plans.flush()
    assert plan(client, "alice") == block and backend.has_block(block["item_id"])
