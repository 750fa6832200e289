"""The tiered store: exact tier contents and eviction order under byte budgets, removal, cascade lookup,
integrity checks, corruption while stored, and concurrent readers."""

from __future__ import annotations

import threading

import pytest
import torch

from kvmem.errors import KVItemCorrupt, KVItemNotFound
from kvmem.kv import KVStoreConfig, PromptLayout, TieredKVStore, build_item
from kvmem.kv.io import item_paths
from tests.kvmem.kv.locks import lock_is_free


@pytest.fixture(scope="module")
def items(tiny_handle):
    layout = PromptLayout(tiny_handle.tokenizer)
    out = []
    for i in range(4):
        ids = layout.block_ids([f"memory {i}: I visited Kyoto in October with my sister."])
        out.append(
            build_item(tiny_handle, ids, user_id="alice" if i < 3 else "bob", memory_ids=[f"m{i}", "shared"])
        )
    assert len({it.meta.num_bytes for it in out}) == 1
    return out


def make_store(tmp_path, handle, nbytes, *, device=None, host=None, disk=None, policy="lru"):
    def b(n):
        return None if n is None else n * nbytes

    return TieredKVStore(
        KVStoreConfig(
            directory=str(tmp_path),
            device_bytes=b(device),
            host_bytes=b(host),
            disk_bytes=b(disk),
            policy=policy,
        ),
        handle.fingerprint,
    )


def test_lru_demotes_device_to_host_to_disk_in_order(tmp_path, tiny_handle, items):
    nbytes = items[0].meta.num_bytes
    store = make_store(tmp_path, tiny_handle, nbytes, device=1, host=1)
    a, b, c, _ = items
    store.put(a)
    store.put(b)
    assert [store.tier_of(x.item_id) for x in (a, b)] == ["host", "device"]
    store.put(c)
    assert [store.tier_of(x.item_id) for x in (a, b, c)] == ["disk", "host", "device"]
    got = store.get(a.item_id)  # disk -> device; c -> host; b (LRU of host) -> dropped from RAM
    assert torch.equal(got.kv, a.kv)
    assert [store.tier_of(x.item_id) for x in (a, b, c)] == ["device", "disk", "host"]
    assert store.num_hits == {"device": 0, "host": 0, "disk": 1, "miss": 0}
    info = store.size_info()
    assert (info.device.num_items, info.host.num_items, info.disk.num_items) == (1, 1, 3)
    assert info.disk.num_bytes == 3 * nbytes and info.device.num_tokens == a.num_tokens


def test_a_demotion_copies_to_host_with_the_lock_free(tmp_path, tiny_handle, items, monkeypatch):
    """Issue 27 item 4: the device-to-host copy of a demoted item (the slow part on a GPU) is made with the
    store's lock released, so a request resolving another item never waits on it; the tiers are settled when
    `put` returns. The copy was made under the lock before."""
    from kvmem.kv.item import KVItem

    nbytes = items[0].meta.num_bytes
    store = make_store(tmp_path, tiny_handle, nbytes, device=1, host=1)
    a, b, _, _ = items
    store.put(a)
    copies: list[tuple[str, bool]] = []
    to = KVItem.to

    def watched_to(self, device):
        copies.append((self.item_id, lock_is_free(store)))
        return to(self, device)

    monkeypatch.setattr(KVItem, "to", watched_to)
    store.put(b)
    assert copies == [(b.item_id, True), (a.item_id, True)]  # b onto the device, then a's demotion
    assert [store.tier_of(x.item_id) for x in (a, b)] == ["host", "device"]


def test_lfu_keeps_the_frequently_used_item(tmp_path, tiny_handle, items):
    nbytes = items[0].meta.num_bytes
    store = make_store(tmp_path, tiny_handle, nbytes, device=2, host=0, policy="lfu")
    a, b, c, _ = items
    store.put(a)
    store.put(b)
    for _ in range(3):
        store.get(a.item_id)
    store.get(b.item_id)  # b is the most recent, but a has more hits
    store.put(c)
    assert [store.tier_of(x.item_id) for x in (a, b, c)] == ["device", "disk", "device"]


def test_disk_budget_drops_items_and_files(tmp_path, tiny_handle, items):
    nbytes = items[0].meta.num_bytes
    store = make_store(tmp_path, tiny_handle, nbytes, device=0, host=0, disk=2)
    a, b, c, _ = items
    for x in (a, b, c):
        store.put(x)
    assert [store.tier_of(x.item_id) for x in (a, b, c)] == [None, "disk", "disk"]
    assert not item_paths(tmp_path, a.item_id)[0].exists()
    with pytest.raises(KVItemNotFound):
        store.get(a.item_id)


def test_restart_finds_items_on_disk(tmp_path, tiny_handle, items):
    store = make_store(tmp_path, tiny_handle, 1)
    store.put(items[0])
    reopened = TieredKVStore(KVStoreConfig(directory=str(tmp_path)), tiny_handle.fingerprint)
    assert reopened.tier_of(items[0].item_id) == "disk"
    assert torch.equal(reopened.get(items[0].item_id).kv, items[0].kv)


def test_remove_cascade_lookup_and_user_isolation(tmp_path, tiny_handle, items):
    store = make_store(tmp_path, tiny_handle, 1)
    for x in items:
        store.put(x)
    a, b, c, d = items
    assert store.items_containing("alice", "m1") == [b.item_id]
    assert store.items_containing("alice", "shared") == sorted(x.item_id for x in (a, b, c))
    assert store.items_containing("bob", "shared") == [d.item_id]
    assert store.item_ids("bob") == [d.item_id]
    assert store.remove(b.item_id) is True
    assert store.remove(b.item_id) is False
    assert store.remove_user("alice") == 2
    assert store.item_ids() == [d.item_id]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f"{d.item_id}.json", f"{d.item_id}.safetensors"]
    )


def test_corrupt_file_while_stored_raises_and_is_dropped(tmp_path, tiny_handle, items):
    nbytes = items[0].meta.num_bytes
    store = make_store(tmp_path, tiny_handle, nbytes, device=0, host=0)
    store.put(items[0])
    tensor_path, _ = item_paths(tmp_path, items[0].item_id)
    data = bytearray(tensor_path.read_bytes())
    data[-10] ^= 0x55
    tensor_path.write_bytes(bytes(data))
    with pytest.raises(KVItemCorrupt, match="checksum"):
        store.get(items[0].item_id)
    assert store.tier_of(items[0].item_id) is None and not tensor_path.exists()


def test_integrity_check_reports_exact_ids(tmp_path, tiny_handle, items):
    store = make_store(tmp_path, tiny_handle, 1)
    for x in items[:3]:
        store.put(x)
    _, manifest = item_paths(tmp_path, items[1].item_id)
    manifest.write_text("garbage")
    report = store.check_integrity()
    assert report.corrupt == (items[1].item_id,)
    assert report.ok == tuple(sorted((items[0].item_id, items[2].item_id)))
    assert store.item_ids() == sorted((items[0].item_id, items[2].item_id))


def test_concurrent_readers_get_the_same_verified_item(tmp_path, tiny_handle, items):
    nbytes = items[0].meta.num_bytes
    store = make_store(tmp_path, tiny_handle, nbytes, device=2, host=0)
    for x in items:
        store.put(x)
    errors, seen = [], []

    def reader(k):
        try:
            for i in range(30):
                it = items[(i + k) % 4]
                got = store.get(it.item_id)
                seen.append(got.item_id == it.item_id and torch.equal(got.kv, it.kv))
        except Exception as exc:  # noqa: BLE001 - collected and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=reader, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(seen) == 180 and all(seen)
    info = store.size_info()
    assert info.device.num_items == 2 and info.disk.num_items == 4


def test_bad_config_names_the_field():
    with pytest.raises(ValueError, match="device_bytes"):
        KVStoreConfig(directory="x", device_bytes=-1)
    with pytest.raises(ValueError, match="supported: fifo, lfu, lru, size_lru"):
        KVStoreConfig(directory="x", policy="random")


def test_items_a_peer_writes_into_the_shared_dir_are_adopted_or_rescanned(tmp_path, tiny_handle, items):
    """Two replicas over one data dir: B scanned before A wrote; B finds A's items by id (`adopt`, the
    content-address lookup of a block) or all at once (`rescan`, a user new to B), and serves them."""
    nbytes = items[0].meta.num_bytes
    a = make_store(tmp_path, tiny_handle, nbytes)
    b = make_store(tmp_path, tiny_handle, nbytes)
    first, second, third, _ = items
    for item in (first, second, third):
        a.put(item)
    assert not b.contains(first.item_id) and b.item_ids("alice") == []
    assert b.adopt(first.item_id) and b.tier_of(first.item_id) == "disk"
    assert torch.equal(b.get(first.item_id).kv, first.kv)
    assert not b.adopt("0" * 32)  # nothing of that id on disk
    assert b.rescan() == 2 and b.item_ids("alice") == sorted(x.item_id for x in (first, second, third))
    assert b.rescan() == 0
