"""A store without a device tier (device_bytes=0: the engine's page pool is the device copy): items live in
host RAM and on disk only, `get` hands out the host tier's own copy (never a second one), a disk item is read
into the host tier, and the host budget evicts in LRU order; `block_tier` and `in_memory` say where a get
reads from."""

from __future__ import annotations

import pytest
import torch

from kvmem.kv import KVStoreConfig, TieredKVStore
from tests.kvmem.kv.test_store import items  # noqa: F401 - the module's fixture


def store_at(tmp_path, handle, host_bytes):
    config = KVStoreConfig(directory=str(tmp_path), device_bytes=0, host_bytes=host_bytes)
    return TieredKVStore(config, handle.fingerprint)


def test_get_hands_out_the_host_copy_and_reads_disk_items_into_host(tmp_path, tiny_handle, items):  # noqa: F811
    a, b, c, _ = items
    store = store_at(tmp_path, tiny_handle, 2 * a.meta.num_bytes)
    for item in (a, b, c):
        store.put(item)
    assert [store.tier_of(x.item_id) for x in (a, b, c)] == ["disk", "host", "host"]  # a: LRU of host
    assert [store.block_tier(x.item_id) for x in (a, b, c)] == ["disk", "host", "host"]
    assert [store.in_memory(x.item_id) for x in (a, b, c)] == [False, True, True]
    assert store.size_info().device.num_items == 0
    held = store._resident["host"][b.item_id]
    assert store.get(b.item_id) is held  # the same tensor: no second copy
    got = store.get(a.item_id)  # disk -> host; c, the LRU of host now, leaves RAM (it is on disk)
    assert torch.equal(got.kv, a.kv) and got is store._resident["host"][a.item_id]
    assert [store.tier_of(x.item_id) for x in (a, b, c)] == ["host", "host", "disk"]
    assert store.num_hits == {"device": 0, "host": 1, "disk": 1, "miss": 0}
    assert store._resident["device"] == {}
    assert store.block_tier("nope") is None


def test_without_host_room_every_get_reads_the_file_and_keeps_nothing_in_ram(tmp_path, tiny_handle, items):  # noqa: F811
    a = items[0]
    store = store_at(tmp_path, tiny_handle, 0)
    store.put(a)
    assert store.tier_of(a.item_id) == "disk"
    assert torch.equal(store.get(a.item_id).kv, a.kv)
    assert store.tier_of(a.item_id) == "disk" and store._resident == {"device": {}, "host": {}}
    assert store.num_hits["disk"] == 1


def test_a_failed_read_of_old_files_never_drops_the_item_rebuilt_under_its_id_meanwhile(
    tmp_path,
    tiny_handle,
    items,  # noqa: F811
    monkeypatch,
):
    """A read of a corrupt file fails after the block was rebuilt (put again, same content address, new files):
    the failure drops nothing; the rebuilt item stays indexed with its files (it dropped the rebuilt one, files
    and all, before: its index entry was the same id)."""
    import dataclasses

    from kvmem.errors import KVItemCorrupt
    from kvmem.kv import store_reads as store_module  # where the store's disk reads call load_item
    from kvmem.kv.io import item_paths
    from kvmem.kv.item import KVItem

    a = items[0]
    store = store_at(tmp_path, tiny_handle, 0)
    store.put(a)
    tensor_path, _ = item_paths(store.directory, a.item_id)
    data = bytearray(tensor_path.read_bytes())
    data[-10] ^= 0x55
    tensor_path.write_bytes(bytes(data))
    rebuilt = KVItem(dataclasses.replace(a.meta), a.token_ids, a.kv)  # a build's new item, the same id
    real_load = store_module.load_item

    def load_then_rebuilt(*args, **kwargs):
        try:
            return real_load(*args, **kwargs)
        except KVItemCorrupt:
            store.put(rebuilt)  # the rebuild lands between the read and its failure's handling
            raise

    monkeypatch.setattr(store_module, "load_item", load_then_rebuilt)
    with pytest.raises(KVItemCorrupt):
        store.get(a.item_id)
    monkeypatch.setattr(store_module, "load_item", real_load)
    assert store.tier_of(a.item_id) == "disk" and store.is_valid_on_disk(a.item_id)
    assert torch.equal(store.get(a.item_id).kv, a.kv)
