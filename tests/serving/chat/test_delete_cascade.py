"""Deletion cascades to every stored KV item (DESIGN invariant 5), not only the current plan's block: items from
a server run before a restart, offline builds written before the server started and while it runs. Through
the HTTP routes, the real scheduler and the transformers backend on the tiny llama: before the call returns,
`store.get` refuses every item that held the memory; no *.json under the data dir names it afterwards."""

from __future__ import annotations

import pytest

from kvmem.errors import KVItemError
from kvmem.kv import KVStoreConfig, PromptLayout, TieredKVStore
from kvmem.kv.blocks import BlockBuilder
from kvmem.models import load_model
from tests.serving.conftest import wait_for
from tests.serving.kvstack import json_texts, load_backend, manifests, served

TEXTS = {"lisbon": "I live in Lisbon.", "miso": "My dog is called Miso.", "violin": "I play the violin."}


def offline_build(model_dir, data_dir, user: str, blocks: list[list[tuple[str, str]]]) -> list[str]:
    """What `kvmem build` does, in its own store over the data dir (another process, as far as the server's
    store knows): one item per block of (memory id, text)."""
    handle = load_model(str(model_dir))
    store = TieredKVStore(
        KVStoreConfig(directory=str(data_dir / "kv"), device_bytes=0, host_bytes=0), handle.fingerprint
    )
    builder = BlockBuilder(handle, PromptLayout(handle.tokenizer), store)
    return [
        builder.build(user, [t for _, t in block], [m for m, _ in block], verify_existing=True).item_id
        for block in blocks
    ]


def refused(store: TieredKVStore, item_id: str) -> bool:
    try:
        store.get(item_id)
    except KVItemError:
        return True
    return False


def naming(data_dir, text: str) -> list[str]:
    return [path for path, body in json_texts(data_dir).items() if text in body]


@pytest.fixture()
def history(tmp_path, tiny_model_dir):
    """Alice's memories (lisbon in session s1, miso and violin in s2) and KV items holding them from every
    source: a first server run (then stopped; the second run restores its plan, then supersedes and frees that
    block when a memory is added), an offline build before the second run; the second run is
    served to the test, which adds one more offline build while it runs."""
    with served(tmp_path, load_backend(tiny_model_dir, tmp_path)) as first:
        ids = {
            "lisbon": first.add("alice", TEXTS["lisbon"], "s1"),
            "miso": first.add("alice", TEXTS["miso"], "s2"),
        }
        first.plans.flush()
        before_restart = first.plan("alice")["item_id"]
    offline_before = offline_build(
        tiny_model_dir,
        tmp_path,
        "alice",
        [[(ids["lisbon"], TEXTS["lisbon"])], [(ids["miso"], TEXTS["miso"])]],
    )
    with served(tmp_path, load_backend(tiny_model_dir, tmp_path)) as s:
        wait_for(lambda: s.client.get("/health").status_code == 200, "plans restored at start", tries=15000)
        assert s.plan("alice")["item_id"] == before_restart  # the restart restored the plan from disk
        ids["violin"] = s.add("alice", TEXTS["violin"], "s2")
        s.plans.flush()
        current = s.plan("alice")
        assert before_restart not in manifests(tmp_path)  # superseded by the new block: freed
        assert current["tier"] == "kv" and sorted(current["memory_ids"]) == sorted(ids.values())
        offline_during = offline_build(
            tiny_model_dir,
            tmp_path,
            "alice",
            [[(ids["violin"], TEXTS["violin"]), (ids["lisbon"], TEXTS["lisbon"])]],
        )
        items = {
            "offline_lisbon": offline_before[0],
            "offline_miso": offline_before[1],
            "current": current["item_id"],
            "offline_during": offline_during[0],
        }
        assert len(set(items.values())) == 4
        assert set(manifests(tmp_path)) == set(items.values())
        assert s.backend.store.item_ids("alice") == sorted(set(items.values()) - {items["offline_during"]})
        yield s, ids, items, tmp_path


@pytest.mark.parametrize("how", ["delete", "delete_session", "patch"])
def test_changing_a_memory_stops_every_item_holding_it_before_the_call_returns(history, how):
    s, ids, items, data_dir = history
    lisbon = ids["lisbon"]
    holding = {k: v for k, v in items.items() if lisbon in manifests(data_dir)[v][1]}
    assert set(holding) == {"offline_lisbon", "current", "offline_during"}
    if how == "delete":
        r = s.client.delete(f"/v1/memories/{lisbon}", params={"user_id": "alice"})
    elif how == "delete_session":
        r = s.client.delete("/v1/memories", params={"user_id": "alice", "session_id": "s1"})
    else:
        r = s.client.patch(f"/v1/memories/{lisbon}", json={"user_id": "alice", "text": "I moved to Porto."})
    assert r.status_code == 200, r.text
    # before anything else runs: no item that held the memory can be served, none is left on disk (the
    # worker may be rebuilding meanwhile: checked exactly below, once it is idle)
    assert {k: refused(s.backend.store, v) for k, v in holding.items()} == dict.fromkeys(holding, True)
    assert set(manifests(data_dir)) & set(holding.values()) == set()
    assert items["offline_miso"] in manifests(data_dir)
    # no plan serves an item that held the old text (null: no block at all; after a PATCH the worker may
    # already have rebuilt one from the new text, which is a new item)
    assert (s.plan("alice") or {"item_id": None})["item_id"] not in holding.values()
    if how != "patch":
        assert lisbon not in (s.plan("alice") or {"memory_ids": []})["memory_ids"]
    s.plans.flush()
    rebuilt = s.plan("alice")
    assert rebuilt["tier"] == "kv"
    assert set(manifests(data_dir)) == {items["offline_miso"], rebuilt["item_id"]}
    if how == "patch":  # the changed memory is served again, from its new text only
        assert lisbon in rebuilt["memory_ids"] and rebuilt["item_id"] not in items.values()
        assert naming(data_dir, lisbon) == [f"kv/{rebuilt['item_id']}.json"]
    else:
        assert sorted(rebuilt["memory_ids"]) == sorted([ids["miso"], ids["violin"]])
        assert naming(data_dir, lisbon) == []


def test_deleting_a_user_removes_every_item_of_theirs_and_no_one_elses(history, tiny_model_dir):
    s, ids, items, data_dir = history
    bob_memory = s.add("bob", "I play the cello.")
    s.plans.flush()
    bob_block = s.plan("bob")["item_id"]
    bob_offline = offline_build(
        tiny_model_dir,
        data_dir,
        "bob",
        [
            [("text:raw", "Bob likes tea.")],
            [(bob_memory, "I play the cello."), ("text:raw2", "Bob is tall.")],
        ],
    )
    bob_items = [bob_block, *bob_offline]
    assert len(set(bob_items)) == 3
    alice_before = {i: m for i, m in manifests(data_dir).items() if m[0] == "alice"}

    r = s.client.delete("/v1/memories", params={"user_id": "bob"})
    assert r.status_code == 200 and r.json() == {"deleted": 1}
    assert [refused(s.backend.store, i) for i in bob_items] == [True, True, True]
    assert s.plan("bob") is None
    s.plans.flush()
    assert naming(data_dir, '"bob"') == []  # not even the block built from raw texts
    assert manifests(data_dir) == alice_before
    assert all(not refused(s.backend.store, i) for i in alice_before if i != items["offline_during"])
