"""Issue 44 items 1, 3, 4 on the tiny llama behind the transformers backend: the page pool is the device tier of
stored blocks (the store keeps host RAM and disk only); a block evicted to disk and read back gives the greedy
tokens of a full prefill; a delete reaches the pool, host and disk copies before it returns, a read from disk
under way included; load or recompute is decided per block from the measured (here: given) costs, both paths
give the same greedy tokens; a prewarm reads the block and puts it in pages off the model thread's file reads."""

from __future__ import annotations

import asyncio
import dataclasses
import threading

import pytest

from kvmem.kv.io import item_paths
from serving.backends.base import BlockNotFound, GenerationRequest, SamplingParams
from serving.backends.transformers.load_costs import Decision, LoadCosts
from tests.serving.backends.test_transformers_backend import tokens_of, wait_released
from tests.serving.kvstack import load_backend

QUESTION = [{"role": "user", "content": "Where do I live and what do I keep?"}]
LOAD = LoadCosts(prefill_s_per_token=1.0, load_s_per_byte={"host": 0.0, "disk": 0.0}, fixed=True)
RECOMPUTE = LoadCosts(prefill_s_per_token=0.0, load_s_per_byte={"host": 1.0, "disk": 1.0}, fixed=True)


def over(backend, user: str, texts: list[str], block, *, with_block: bool = True) -> GenerationRequest:
    """A greedy request whose prompt starts with the block; without it (`with_block=False`) it prefills it."""
    prompt = backend.layout_prompt(texts, [], QUESTION, block.token_ids)
    item_id = block.item_id if with_block else None
    return GenerationRequest(
        f"r-{user}", user, prompt, item_id, SamplingParams(max_new_tokens=8, temperature=0.0)
    )


def run(backend, req):
    return asyncio.run(tokens_of(backend, req))


def host_budget(backend, nbytes: int) -> None:
    """The store's host RAM budget, set on its config (what `--kv-host-mb` sets at start)."""
    backend.store.config = dataclasses.replace(backend.store.config, host_bytes=nbytes)


@pytest.fixture
def backend(tiny_model_dir, tmp_path):
    backend = load_backend(tiny_model_dir, tmp_path)
    backend.costs = LOAD
    yield backend
    asyncio.run(backend.aclose())


def test_the_pool_is_the_only_device_copy_and_the_store_keeps_host_and_disk(backend):
    texts = ["I live in Porto.", "I keep bees."]
    block = backend.build_block("one", texts, ["m1", "m2"])
    ids, result = run(backend, over(backend, "one", texts, block))
    assert result.cached_tokens == block.num_tokens
    store = backend.store
    assert store.config.device_bytes == 0 and store.size_info().device.num_items == 0
    assert store.tier_of(block.item_id) == "host" and block.item_id in backend.pool.shared
    held = store._resident["host"][block.item_id]
    assert store.get(block.item_id) is held  # the store hands out its host copy: no second one
    prefill = float(block.num_tokens - backend.head_item.num_tokens)  # 1 s a token (LOAD), the head reused
    assert backend.block_residency(block.item_id) == {
        "tier": "pool",
        "path": "load",
        "load_s": 0.0,
        "recompute_s": prefill,
    }


def test_a_block_evicted_to_disk_and_read_back_gives_the_greedy_tokens_of_a_full_prefill(backend):
    user, porto, faro = "evict", ["I live in Porto.", "I keep bees."], ["I live in Faro.", "I keep goats."]
    a = backend.build_block(user, porto, ["p1", "p2"])
    b = backend.build_block(user, faro, ["f1", "f2"])
    host_budget(backend, max(a.num_bytes, b.num_bytes))  # room for one of them
    backend.store.get(b.item_id)  # host keeps b; a, the least recently used, leaves RAM for disk
    assert (backend.store.tier_of(a.item_id), backend.store.tier_of(b.item_id)) == ("disk", "host")
    full, _ = run(backend, over(backend, user, porto, a, with_block=False))
    loads = backend.store.disk_loads["loads"]
    ids, result = run(backend, over(backend, user, porto, a))
    assert ids == full
    assert result.cached_tokens == a.num_tokens and result.kv_fallback_reason is None
    assert backend.store.disk_loads["loads"] == loads + 1  # read once, on an I/O thread
    assert (backend.store.tier_of(a.item_id), backend.store.tier_of(b.item_id)) == ("host", "disk")
    stats = backend.kv_tier_stats()["tiers"]
    assert {t: (s["hits"], s["misses"]) for t, s in stats.items()} == {
        "pool": (0, 1),
        "host": (0, 1),
        "disk": (1, 0),
    }
    assert stats["disk"]["loads"] == loads + 1 and stats["disk"]["items"] == 2
    assert stats["pool"]["items"] == 1
    assert stats["host"]["loads"] == 2  # copies into pages: the shared head's (the full prefill's), then a's
    again, result = run(backend, over(backend, user, porto, a))  # now read by reference from the pool
    assert again == full and backend.kv_tier_stats()["tiers"]["pool"]["hits"] == 1
    wait_released(backend)


def test_load_or_recompute_follows_the_given_costs_and_both_give_the_same_tokens(backend, caplog):
    user, texts = "costs", ["I live in Braga.", "I keep cats."]
    block = backend.build_block(user, texts, ["b1", "b2"])
    full, _ = run(backend, over(backend, user, texts, block, with_block=False))
    backend.costs = RECOMPUTE  # a copy from RAM costs 1 s a byte, a prefill nothing
    decision = backend.decide_block(block.item_id)
    stored = backend.store.meta(block.item_id).stored_bytes
    prefill = block.num_tokens - backend.head_item.num_tokens
    assert decision == Decision("host", "recompute", float(stored), 0.0)
    with caplog.at_level("INFO", logger="serving.backends.transformers.backend"):
        recomputed, result = run(backend, over(backend, user, texts, block))
    assert recomputed == full
    assert (result.kv_fallback_reason, result.cached_tokens) == ("recompute", 0)
    assert f"block {block.item_id} prefilled as text: a load from host" in caplog.text
    assert block.item_id not in backend.pool.shared  # nothing copied
    backend.costs = LOAD
    assert backend.decide_block(block.item_id) == Decision("host", "load", 0.0, float(prefill))
    loaded, result = run(backend, over(backend, user, texts, block))
    assert loaded == full and result.kv_fallback_reason is None
    assert result.cached_tokens >= block.num_tokens  # the block, and pages earlier turns left (prefix reuse)
    paths = backend.kv_tier_stats()["paths"]
    assert paths == [
        {"tier": "host", "path": "load", "requests": 1},
        {"tier": "host", "path": "recompute", "requests": 1},
    ]
    backend.costs = RECOMPUTE  # the pool costs nothing: loaded whatever the rates
    assert backend.decide_block(block.item_id) == Decision("pool", "load", 0.0, 0.0)


def test_a_recompute_reads_the_block_into_ram_for_the_next_request(backend):
    user, texts = "warmup", ["I live in Evora.", "I keep hens."]
    block = backend.build_block(user, texts, ["e1", "e2"])
    host_budget(backend, 0)
    backend.store.get(block.item_id)  # over the budget: it leaves RAM
    assert backend.store.tier_of(block.item_id) == "disk"
    host_budget(backend, None)
    backend.costs = RECOMPUTE
    _, result = run(backend, over(backend, user, texts, block))
    assert result.kv_fallback_reason == "recompute"
    future = backend._fetches.get(block.item_id)
    if future is not None:
        future.result(timeout=30)
    assert backend.store.tier_of(block.item_id) == "host"  # read in the background, off the request


def test_a_delete_reaches_the_pool_host_and_disk_copies_before_it_returns_during_a_read(backend):
    user, porto, faro = "del", ["I live in Porto.", "I keep bees."], ["I live in Faro.", "I keep goats."]
    a = backend.build_block(user, porto, ["p1", "p2"])
    b = backend.build_block(user, faro, ["f1", "f2"])
    host_budget(backend, max(a.num_bytes, b.num_bytes))  # room for one of them
    run(backend, over(backend, user, porto, a))  # a: in pages, in RAM (b, older, leaves RAM), on disk
    assert a.item_id in backend.pool.shared and backend.store.tier_of(a.item_id) == "host"
    assert backend.store.tier_of(b.item_id) == "disk"
    reading, go = threading.Event(), threading.Event()
    readers: list[str] = []

    def hold(item_id: str) -> None:
        readers.append(threading.current_thread().name)
        if item_id == b.item_id:
            reading.set()
            go.wait(30)

    backend.store.before_disk_read = hold
    outcome: list[BaseException | None] = []

    def request_b() -> None:
        try:
            run(backend, over(backend, user, faro, b))
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - checked below
            outcome.append(exc)

    thread = threading.Thread(target=request_b)
    thread.start()
    assert reading.wait(30)  # b's read from disk is under way
    assert backend.forget(user, ["p1", "f1"]) == sorted([a.item_id, b.item_id])
    # before the delete returned: no copy of either anywhere
    for block in (a, b):
        assert block.item_id not in backend.pool.shared
        assert backend.store.tier_of(block.item_id) is None
        assert not any(p.exists() for p in item_paths(backend.store.directory, block.item_id))
    assert backend.store._resident == {"device": {}, "host": {}}
    go.set()
    thread.join(30)
    assert isinstance(outcome[0], BlockNotFound)  # the read was refused: the request is prepared again
    assert readers and all(name.startswith("kvmem-io") for name in readers)  # never the model thread
    assert b.item_id not in backend.pool.shared and backend.store._resident["host"] == {}
    wait_released(backend)
    assert backend.pool.used_pages == backend.pool.shared.page_count()


def test_a_prewarm_puts_the_block_in_pages_and_a_delete_during_its_read_leaves_none(backend):
    user, texts = "warm", ["I live in Tavira.", "I keep doves."]
    block = backend.build_block(user, texts, ["t1", "t2"])
    host_budget(backend, 0)
    backend.store.get(block.item_id)
    assert backend.store.tier_of(block.item_id) == "disk" and block.item_id not in backend.pool.shared
    host_budget(backend, None)
    backend.warm_block(block.item_id)
    backend._loop.call(lambda: None)  # the copy into pages ran on the model thread
    assert block.item_id in backend.pool.shared and backend.store.tier_of(block.item_id) == "host"
    ids, result = run(backend, over(backend, user, texts, block))
    assert result.cached_tokens == block.num_tokens

    other = backend.build_block(user, ["I live in Lagos."], ["l1"])
    host_budget(backend, 0)
    backend.store.get(other.item_id)
    host_budget(backend, None)
    reading, go = threading.Event(), threading.Event()
    backend.store.before_disk_read = lambda item_id: (reading.set(), go.wait(30))
    warming = threading.Thread(target=backend.warm_block, args=(other.item_id,))
    warming.start()
    assert reading.wait(30)
    assert backend.forget(user, ["l1"]) == [other.item_id]
    go.set()
    warming.join(30)
    backend._loop.call(lambda: None)
    assert other.item_id not in backend.pool.shared and backend.store.tier_of(other.item_id) is None


def test_the_cost_model_decides_from_its_rates():
    costs = LoadCosts(prefill_s_per_token=0.001, load_s_per_byte={"host": 1e-9, "disk": 1e-8}, fixed=True)
    # 10 MB and 1,000 tokens: RAM 0.01 s, disk 0.11 s (the read, then the copy), prefill 1 s
    assert costs.decide("disk", 10_000_000, 1000) == Decision("disk", "load", pytest.approx(0.11), 1.0)
    # 1 GB: the disk read takes 11 s, the prefill 1 s
    assert costs.decide("disk", 1_000_000_000, 1000).path == "recompute"
    assert costs.decide("host", 1_000_000_000, 1000).path == "load"  # 1 s: saves nothing
    assert costs.decide("pool", 10**12, 1) == Decision("pool", "load", 0.0, 0.001)
    assert costs.decide(None, 1, 1) == Decision(None, None, None, None)
    unmeasured = LoadCosts(prefill_s_per_token=0.001)
    assert unmeasured.decide("disk", 10**12, 1) == Decision(
        "disk", "load", None, 0.001
    )  # its loads measure it
    unmeasured.measured("disk", 64 << 20, 64.0)  # 1 s a MiB
    assert unmeasured.decide("disk", 1 << 20, 10).path == "recompute"
    unmeasured.measured("disk", 1 << 20, 1000.0)  # under MIN_MEASURED_BYTES: not trusted
    assert unmeasured.decide("disk", 1 << 20, 10).path == "load"
    with pytest.raises(ValueError, match=r"load costs are per tier host or disk, got \['pool'\]"):
        LoadCosts(load_s_per_byte={"pool": 0.0})
