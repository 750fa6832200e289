"""The store reports what it drops on its own (exact items and reasons, after its lock is released), and
`forget` (the delete cascade) covers items in every tier and items on disk it never indexed."""

from __future__ import annotations

import pytest

from kvmem.errors import KVItemCorrupt, KVItemNotFound
from kvmem.kv import KVStoreConfig, PromptLayout, TieredKVStore, build_item
from kvmem.kv.cascade import forget_on_disk
from kvmem.kv.io import item_paths
from kvmem.kv.store import DroppedItem
from tests.kvmem.kv.locks import lock_is_free


@pytest.fixture(scope="module")
def items(tiny_handle):
    layout = PromptLayout(tiny_handle.tokenizer)
    specs = [("alice", ["m0", "shared"]), ("alice", ["m1"]), ("alice", ["m2", "shared"]), ("bob", ["shared"])]
    return [
        build_item(tiny_handle, layout.block_ids([f"memory {i}: I visited Kyoto."]), user_id=u, memory_ids=m)
        for i, (u, m) in enumerate(specs)
    ]


def store_at(path, handle, **budgets) -> TieredKVStore:
    return TieredKVStore(KVStoreConfig(directory=str(path), **budgets), handle.fingerprint)


def listen(store: TieredKVStore) -> list[DroppedItem]:
    heard: list[DroppedItem] = []

    def callback(dropped: DroppedItem) -> None:
        assert lock_is_free(store)  # called with the store's lock released
        heard.append(dropped)

    store.subscribe_drops(callback)
    return heard


def test_drops_are_reported_with_their_reason(tmp_path, tiny_handle, items):
    a, b, c, d = items
    nbytes = a.meta.num_bytes
    store = store_at(tmp_path, tiny_handle, device_bytes=0, host_bytes=0, disk_bytes=2 * nbytes)
    heard = listen(store)
    for x in (a, b, c):
        store.put(x)
    assert heard == [DroppedItem(a.item_id, "alice", "evicted")]
    tensor, _ = item_paths(tmp_path, b.item_id)
    tensor.write_bytes(tensor.read_bytes()[:-8])
    with pytest.raises(KVItemCorrupt):
        store.get(b.item_id)
    for path in item_paths(tmp_path, c.item_id):
        path.unlink()  # gone behind the store's back
    with pytest.raises(KVItemNotFound):
        store.get(c.item_id)
    assert heard[1:] == [
        DroppedItem(b.item_id, "alice", "corrupt"),
        DroppedItem(c.item_id, "alice", "not_found"),
    ]
    assert store.item_ids() == []
    store.put(d)
    store.remove(d.item_id)  # an explicit removal is the caller's own business: not reported
    assert len(heard) == 3


def test_a_ram_only_item_evicted_from_ram_is_reported(tmp_path, tiny_handle, items):
    a, b, _, _ = items
    store = store_at(tmp_path, tiny_handle, device_bytes=0, host_bytes=a.meta.num_bytes)
    heard = listen(store)
    store.put(a, persist=False)
    store.put(b, persist=False)
    assert heard == [DroppedItem(a.item_id, "alice", "evicted")]


def test_integrity_check_reports_what_it_drops(tmp_path, tiny_handle, items):
    store = store_at(tmp_path, tiny_handle)
    heard = listen(store)
    store.put(items[0])
    tensor, _ = item_paths(tmp_path, items[0].item_id)
    tensor.write_bytes(b"garbage")
    assert store.check_integrity().corrupt == (items[0].item_id,)
    assert heard == [DroppedItem(items[0].item_id, "alice", "corrupt")]


def test_forget_covers_every_tier_and_items_it_never_indexed(tmp_path, tiny_handle, items):
    a, b, c, d = items
    nbytes = a.meta.num_bytes
    store = store_at(tmp_path, tiny_handle, device_bytes=nbytes, host_bytes=nbytes)
    heard = listen(store)
    store.put(a)  # device, then host
    store.put(d)  # bob's: device
    store.put(b, persist=False)  # RAM only
    late = store_at(tmp_path, tiny_handle)  # another process writing to the same directory
    late.put(c)
    assert store.item_ids() == sorted([a.item_id, b.item_id, d.item_id])
    assert store.items_containing("alice", "shared") == sorted([a.item_id, c.item_id])

    assert store.forget("alice", ["shared"]) == sorted([a.item_id, c.item_id])
    for x in (a, c):
        with pytest.raises(KVItemNotFound):
            store.get(x.item_id)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f"{d.item_id}.json", f"{d.item_id}.safetensors"]
    )
    assert store.forget("alice", ["shared"]) == []
    assert store.forget("alice") == [b.item_id]  # the whole user: the RAM-only item too
    assert store.item_ids() == [d.item_id] and heard == []


def test_forget_on_disk_before_any_store_is_open(tmp_path, tiny_handle, items):
    writer = store_at(tmp_path, tiny_handle)
    for x in items:
        writer.put(x)
    a, b, c, d = items
    assert forget_on_disk(tmp_path, "alice", ["shared", "m1"]) == sorted([a.item_id, b.item_id, c.item_id])
    assert store_at(tmp_path, tiny_handle).item_ids() == [d.item_id]
    assert forget_on_disk(tmp_path, "bob") == [d.item_id]
    assert list(tmp_path.iterdir()) == []


def test_the_cascade_scans_and_deletes_files_with_the_lock_free(tmp_path, tiny_handle, items, monkeypatch):
    """Issue 27 item 4: `forget` reads the directory (an item another process wrote) and deletes files with the
    store's lock released, so a request resolving another item (`get`, `contains`) never waits on them; the
    files are still gone when `forget` returns. Both ran under the lock before."""
    import kvmem.kv.store as store_module

    a, b, c, d = items
    store = store_at(tmp_path, tiny_handle)
    store.put(a)
    store.put(d)
    store_at(tmp_path, tiny_handle).put(c)  # another process's item: only a scan finds it
    seen: list[tuple[str, bool]] = []

    scan, delete = store_module.disk_metas, store_module.delete_item_files

    def watched_scan(*args, **kwargs):
        seen.append(("scan", lock_is_free(store)))
        return scan(*args, **kwargs)

    def watched_delete(directory, item_id):
        seen.append((item_id, lock_is_free(store)))
        return delete(directory, item_id)

    monkeypatch.setattr(store_module, "disk_metas", watched_scan)
    monkeypatch.setattr(store_module, "delete_item_files", watched_delete)
    assert store.forget("alice", ["shared"]) == sorted([a.item_id, c.item_id])
    assert seen == [("scan", True), *((i, True) for i in sorted([a.item_id, c.item_id]))]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f"{d.item_id}.json", f"{d.item_id}.safetensors"]
    )
    assert store.get(d.item_id).item_id == d.item_id
