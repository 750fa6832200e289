"""One user's cap in the store's host RAM and disk tiers (`KVStoreConfig.user_bytes`, `--kv-user-mb`): past it
that user's own least recently used items leave, never another user's and never the item just put or read;
shared knowledge (owner "") is not capped; the cap holds with users putting at once."""

from __future__ import annotations

import threading

import pytest

from kvmem.errors import KVItemNotFound
from kvmem.kv import KVStoreConfig, PromptLayout, TieredKVStore
from kvmem.kv.blocks import build_item
from tests.kvmem.kv.test_store import items  # noqa: F401 - the module's fixture


def capped(tmp_path, handle, user_bytes, *, host_bytes=None):
    config = KVStoreConfig(
        directory=str(tmp_path), device_bytes=0, host_bytes=host_bytes, user_bytes=user_bytes
    )
    return TieredKVStore(config, handle.fingerprint)


def user_bytes(store, tier, user):
    with store._lock:
        return store._user_bytes(tier, user)


def test_a_user_over_the_cap_loses_their_own_oldest_item_and_no_one_elses(tmp_path, tiny_handle, items):  # noqa: F811
    a, b, c, d = items  # a, b, c: alice's; d: bob's; all the same size
    size = a.meta.stored_bytes
    store = capped(tmp_path, tiny_handle, 2 * size)
    dropped = []
    store.subscribe_drops(dropped.append)
    store.put(d)
    for item in (a, b):
        store.put(item)
    store.get(a.item_id)  # a is now alice's most recently used, b her least
    store.put(c)
    assert [store.tier_of(x.item_id) for x in (a, b, c, d)] == ["host", None, "host", "host"]
    assert [(x.item_id, x.user_id, x.reason) for x in dropped] == [(b.item_id, "alice", "evicted")]
    assert not any(p.name.startswith(b.item_id) for p in tmp_path.iterdir())  # its files went with it
    with pytest.raises(KVItemNotFound):
        store.get(b.item_id)
    assert user_bytes(store, "disk", "alice") == 2 * size and user_bytes(store, "host", "alice") == 2 * size
    assert user_bytes(store, "disk", "bob") == size


def test_the_cap_holds_in_ram_and_on_disk_apart_and_the_item_just_put_stays(tmp_path, tiny_handle, items):  # noqa: F811
    a, b, c, _ = items
    size = a.meta.stored_bytes
    store = capped(tmp_path, tiny_handle, size // 2)  # below one item: only the newest is kept
    for item in (a, b, c):
        store.put(item)
    assert [store.tier_of(x.item_id) for x in (a, b, c)] == [None, None, "host"]
    store = capped(tmp_path / "ram0", tiny_handle, 2 * size, host_bytes=0)  # nothing in RAM: disk's cap alone
    for item in (a, b, c):
        store.put(item)
    assert [store.tier_of(x.item_id) for x in (a, b, c)] == [None, "disk", "disk"]
    assert store.get(b.item_id).num_tokens == b.num_tokens  # read from disk; c stays, the cap is met


def test_shared_knowledge_is_not_capped(tmp_path, tiny_handle):
    layout = PromptLayout(tiny_handle.tokenizer)
    shared = [build_item(tiny_handle, layout.block_ids([f"shared fact {i}."]), user_id="") for i in range(3)]
    store = capped(tmp_path, tiny_handle, 1)
    for item in shared:
        store.put(item)
    assert [store.tier_of(x.item_id) for x in shared] == ["host"] * 3


def test_the_cap_holds_with_users_putting_at_once(tmp_path, tiny_handle):
    """Four users put five blocks each from their own threads (blocks of different lengths): at the end each
    user's bytes in RAM and on disk are within the cap, each keeps their newest blocks that fit
    (the next older one would not), and so no one lost another's."""
    layout = PromptLayout(tiny_handle.tokenizer)
    users = ["u0", "u1", "u2", "u3"]
    blocks = {
        u: [
            build_item(
                tiny_handle, layout.block_ids([f"{u} fact {k}: " + "word " * (3 + 4 * k + j)]), user_id=u
            )
            for k in range(5)
        ]
        for j, u in enumerate(users)
    }
    cap = 2 * max(it.meta.stored_bytes for its in blocks.values() for it in its)
    store = capped(tmp_path, tiny_handle, cap)
    barrier = threading.Barrier(len(users))
    errors: list[BaseException] = []

    def run(user: str) -> None:
        try:
            barrier.wait()
            for item in blocks[user]:
                store.put(item)
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(u,)) for u in users]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert errors == [] and not any(t.is_alive() for t in threads)
    for user in users:
        assert 0 < user_bytes(store, "disk", user) <= cap and user_bytes(store, "host", user) <= cap
        assert store.tier_of(blocks[user][-1].item_id) == "host"
        kept = [it for it in blocks[user] if store.tier_of(it.item_id) is not None]
        assert kept == blocks[user][-len(kept) :]  # their newest ones, in order
        dropped_next = blocks[user][-len(kept) - 1]  # the newest they lost: it would not have fit
        assert sum(it.meta.stored_bytes for it in [dropped_next, *kept]) > cap
