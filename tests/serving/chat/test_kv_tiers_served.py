"""Issue 44 through the HTTP app (tiny llama, transformers backend, real scheduler): a chat's block on disk is
read on an I/O thread as soon as the chat path reads the plan, before the request is admitted to the backend,
and the request joins that read; /metrics and the plan route say where each block is and which path it takes;
a corrupt or missing file on the disk tier falls back to text with a log line and the block is rebuilt."""

from __future__ import annotations

import dataclasses
import threading

import pytest

from kvmem.kv.io import item_paths
from serving.backends.transformers.load_costs import LoadCosts
from tests.serving.kvstack import load_backend, served

LOAD = LoadCosts(prefill_s_per_token=1.0, load_s_per_byte={"host": 0.0, "disk": 0.0}, fixed=True)


def cached(out: dict) -> int:
    return out["usage"]["prompt_tokens_details"]["cached_tokens"]


def metric(text: str, line_start: str) -> str:
    [line] = [x for x in text.splitlines() if x.startswith(line_start + " ")]
    return line.split(" ")[-1]


def test_a_block_on_disk_is_read_at_arrival_before_admission_and_the_request_joins_it(
    tmp_path, tiny_model_dir
):
    backend = load_backend(tiny_model_dir, tmp_path)
    backend.costs = LOAD
    with served(tmp_path, backend) as s:
        s.add("alice", "I live in Lisbon.")
        s.add("bob", "I play the violin.")
        s.plans.flush()
        alice, bob = s.plan("alice"), s.plan("bob")
        budget = max(alice["bytes"], bob["bytes"])
        backend.store.config = dataclasses.replace(
            backend.store.config, host_bytes=budget
        )  # one block in RAM
        backend.store.get(bob["item_id"])  # bob's stays in RAM, alice's leaves it for disk
        assert backend.store.tier_of(alice["item_id"]) == "disk"
        plan = s.client.get("/v1/memories/plan", params={"user_id": "alice"}).json()
        assert plan["kv"] == {
            "tier": "disk",
            "path": "load",
            "load_s": 0.0,
            "recompute_s": plan["kv"]["recompute_s"],
        }
        reads: list[tuple[str, str]] = []
        started: list[tuple[str, int]] = []

        def seen(item_id: str) -> None:  # on the reading thread, just before the file is read
            reads.append((item_id, threading.current_thread().name))

        fetch = backend._fetch

        def fetch_noting_admission(item_id: str):
            started.append((item_id, backend.queue_depth))
            return fetch(item_id)

        backend.store.before_disk_read = seen
        backend._fetch = fetch_noting_admission
        loads = backend.store.disk_loads["loads"]
        out = s.chat("alice")
        assert cached(out) == alice["tokens"]
        # the read was started while the request was not yet admitted to the backend (queue depth 0; when the I/O
        # thread gets to it depends on the machine's load), the request joined it (no second start), and the file
        # was read once, on an I/O thread
        assert started == [(alice["item_id"], 0), (alice["item_id"], 1)] or started == [(alice["item_id"], 0)]
        assert reads == [(alice["item_id"], reads[0][1])] and reads[0][1].startswith("kvmem-io")
        assert backend.store.disk_loads["loads"] == loads + 1
        metrics = s.client.get("/metrics").text
        assert metric(metrics, 'kvmem_kv_tier_hits_total{tier="disk"}') == "1"
        assert metric(metrics, 'kvmem_kv_tier_misses_total{tier="pool"}') == "1"
        assert metric(metrics, 'kvmem_kv_tier_misses_total{tier="host"}') == "1"
        assert metric(metrics, 'kvmem_kv_tier_loads_total{tier="disk"}') == str(loads + 1)
        assert metric(metrics, 'kvmem_kv_tier_items{tier="disk"}') == "2"
        assert metric(metrics, 'kvmem_kv_tier_items{tier="host"}') == "1"
        assert metric(metrics, 'kvmem_kv_tier_items{tier="pool"}') == "1"
        assert metric(metrics, 'kvmem_kv_path_total{tier="disk",path="load"}') == "1"
        assert metric(metrics, "kvmem_kv_prefill_seconds_per_token") == "1.0"
        assert metric(metrics, 'kvmem_kv_load_seconds_per_byte{tier="disk"}') == "0.0"
        plan = s.client.get("/v1/memories/plan", params={"user_id": "alice"}).json()
        assert (plan["kv"]["tier"], plan["kv"]["path"], plan["kv"]["load_s"]) == ("pool", "load", 0.0)
        assert s.client.get("/v1/memories/plan", params={"user_id": "nobody"}).json()["kv"] is None


@pytest.mark.parametrize("damage", ["corrupt", "missing"])
def test_a_corrupt_or_missing_file_falls_back_to_text_with_a_log_line_and_is_rebuilt(
    tmp_path, tiny_model_dir, caplog, damage
):
    backend = load_backend(tiny_model_dir, tmp_path, host_kv_bytes=0)  # the block lives on disk only
    backend.costs = LOAD
    with served(tmp_path, backend) as s:
        lisbon = s.add("alice", "I live in Lisbon.")
        s.plans.flush()
        block = s.plan("alice")
        tensor_path, _ = item_paths(backend.store.directory, block["item_id"])
        if damage == "corrupt":
            data = bytearray(tensor_path.read_bytes())
            data[-10] ^= 0x55
            tensor_path.write_bytes(bytes(data))
        else:
            tensor_path.unlink()
        with caplog.at_level("WARNING"):
            fell_back = s.chat("alice")
        assert fell_back["memory"]["used"] == [{"id": lisbon, "tier": "text"}]  # the block was not read
        assert (
            f"dropping unusable KV item {block['item_id']}: KV item {block['item_id']}: tensor file"
            in caplog.text
        )
        s.plans.flush()  # the store dropped the item, the scheduler heard it and rebuilt the block
        assert s.plan("alice") == block
        assert backend.store.is_valid_on_disk(block["item_id"])
        # the block alone: a chat before over the same content address may have left full pages past it in the
        # prefix cache (its own tests), which would be reused too
        backend.pool.prefix.drop_user("alice")
        again = s.chat("alice")
        assert cached(again) == block["tokens"]
        assert again["memory"]["used"] == [{"id": lisbon, "tier": "kv"}]


def test_the_user_quota_sizes_the_block_so_it_holds_in_every_tier(tmp_path, tiny_model_dir):
    """`--kv-user-mb` reaches the pool, the store (host RAM and disk) and the scheduler: a heavy user's block is
    built within the quota (by the loaded model's bytes per token, not the scheduler's default guess) and served
    from KV; the memories past it are left to text retrieval; a light user's block is whole."""
    backend = load_backend(tiny_model_dir, tmp_path, kv_user_bytes=1 << 20)
    per_token = backend.kv_bytes_per_token()
    assert per_token == 512  # 2 layers x K,V x 2 heads x 16 dims x 4 bytes
    assert backend.store.config.user_bytes == 1 << 20 and backend.pool.residency.quota_pages is not None
    backend.costs = LOAD
    with served(tmp_path, backend, kv_user_mb=1, block_token_budget=8192) as s:
        line = "I keep a long diary of the trains I took across the country in the spring of that year " * 6
        heavy = [s.add("alice", f"Note {k}: {line}") for k in range(30)]
        light = s.add("bob", "I play the violin.")
        s.plans.flush()
        block, bobs = s.plan("alice"), s.plan("bob")
        memory_tokens = sum(backend.count_tokens(f"Note {k}: {line}") for k in range(30))
        assert memory_tokens * per_token > 1 << 20  # her memories alone are over the quota
        assert block["bytes"] <= 1 << 20 and block["bytes"] == block["tokens"] * per_token
        assert block["tokens"] > (1 << 20) // per_token // 2  # sized by the model's 512, not the 46 KB guess
        assert bobs["memory_ids"] == [light]
        assert backend.store.tier_of(block["item_id"]) == "host"
        out = s.chat("alice")
        assert 0 < len(block["memory_ids"]) < len(heavy) and set(block["memory_ids"]) <= set(heavy)
        assert cached(out) == block["tokens"]  # served from the capped block
        kv = sorted(u["id"] for u in out["memory"]["used"] if u["tier"] == "kv")
        assert kv == sorted(block["memory_ids"])
