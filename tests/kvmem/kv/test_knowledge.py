"""Shared knowledge blocks: `kvmem build --knowledge FILE` stores the knowledge once, every user's block is
its child (own tokens' K/V only), generation from a child is token-identical to a full prefill, a user's
delete leaves the knowledge and the other users alone, and changed knowledge never serves an old child."""

from __future__ import annotations

import json

import pytest

from benchmarks.ttft.ttft_grid import reference_tokens
from kvmem.kv import KVStoreConfig, PromptLayout, Sampling, TieredKVStore, generate
from kvmem.kv.io import item_paths
from kvmem.kv.knowledge import KNOWLEDGE_OWNER, KnowledgeFileError, installed, parse_knowledge_file
from kvmem.text import MemoryStore
from serving.ops.build_cli import main

KNOWLEDGE = [
    "Our shop opens at 9am and closes at 6pm.",
    "Returns are accepted within 30 days with a receipt.",
    "Shipping to Portugal takes three working days.",
]


def seed(data):
    with MemoryStore(data / "memories.sqlite") as store:
        store.add("alice", texts=["Alice lives in Lisbon.", "Alice has a cat named Miso."])
        store.add("bob", texts=["Bob collects stamps."])


def kv_store(data, handle):
    return TieredKVStore(KVStoreConfig(directory=str(data / "kv")), handle.fingerprint)


def test_parse_knowledge_file(tmp_path):
    f = tmp_path / "k.txt"
    f.write_text('plain line\n\n"a json string"\n{"text": "a json object"}\n')
    assert parse_knowledge_file(f) == ["plain line", "a json string", "a json object"]
    f.write_text('{"text": 3}\n')
    with pytest.raises(KnowledgeFileError, match="line 1"):
        parse_knowledge_file(f)
    f.write_text("\n\n")
    with pytest.raises(KnowledgeFileError, match="no texts"):
        parse_knowledge_file(f)


def test_knowledge_parent_children_exact_isolated(tmp_path, tiny_model_dir, tiny_handle, capsys):
    data = tmp_path / "data"
    seed(data)
    kfile = tmp_path / "knowledge.jsonl"
    kfile.write_text("\n".join(json.dumps({"text": t}) for t in KNOWLEDGE) + "\n")
    argv = ["--data-dir", str(data), "--model", str(tiny_model_dir), "--no-progress"]
    assert main([*argv, "--knowledge", str(kfile)]) == 0
    assert "built 2, skipped 0 (already valid), failed 0" in capsys.readouterr().err
    assert installed(data) == tuple(KNOWLEDGE)

    store = kv_store(data, tiny_handle)
    layout = PromptLayout(tiny_handle.tokenizer, knowledge=KNOWLEDGE)
    k = len(layout.knowledge_ids)
    metas = {i: store.meta(i) for i in store.item_ids()}
    parents = [i for i, m in metas.items() if m.user_id == KNOWLEDGE_OWNER]
    assert len(parents) == 1 and metas[parents[0]].num_tokens == k
    children = {m.user_id: i for i, m in metas.items() if m.user_id != KNOWLEDGE_OWNER}
    assert sorted(children) == ["alice", "bob"]
    for item_id in children.values():
        meta = metas[item_id]
        assert (meta.parent_id, meta.parent_tokens) == (parents[0], k)
        # the child's file holds its own tokens only: smaller than the parent's, which holds K tokens
        own = meta.num_tokens - k
        assert 0 < own < k
        tensor_file, _ = item_paths(data / "kv", item_id)
        parent_file, _ = item_paths(data / "kv", parents[0])
        assert tensor_file.stat().st_size < parent_file.stat().st_size

    # exactness: a child joined to its parent (a fresh store loads both from disk) gives the tokens of a
    # full prefill of [knowledge][user memories][query]
    fresh = kv_store(data, tiny_handle)
    item = fresh.get(children["alice"])
    texts = layout_block_texts(data, "alice", item.meta.memory_ids)
    prompt = layout.prompt(texts, [], [{"role": "user", "content": "When does the shop open?"}])
    assert prompt.ids[: item.num_tokens] == item.token_ids
    assert item.token_ids[:k] == layout.knowledge_ids
    ours = list(generate(tiny_handle.model, prompt.ids, item=item, sampling=Sampling(max_new_tokens=8)))
    assert ours == reference_tokens(tiny_handle.model, list(prompt.ids), 8, "cpu")

    # a user's delete: their child goes, the knowledge and the other user's child stay and still load
    assert fresh.forget("alice") == [children["alice"]]
    assert sorted(fresh.item_ids()) == sorted([parents[0], children["bob"]])
    assert kv_store(data, tiny_handle).get(children["bob"]).num_tokens == metas[children["bob"]].num_tokens

    # resume: nothing to build, no model load
    assert main(argv) == 0
    assert "built 1, skipped 1 (already valid), failed 0" in capsys.readouterr().err  # alice's rebuilt

    # changed knowledge: every child is rebuilt under a new parent; the old ones are never looked up
    kfile.write_text("Our shop now opens at 10am.\n")
    assert main([*argv, "--knowledge", str(kfile)]) == 0
    assert "built 2, skipped 0 (already valid), failed 0" in capsys.readouterr().err
    new_metas = {i: m for i, m in kv_store(data, tiny_handle)._indexed_metas().items()}
    new_parent = [i for i, m in new_metas.items() if m.user_id == KNOWLEDGE_OWNER and i not in parents]
    assert len(new_parent) == 1
    assert {m.parent_id for m in new_metas.values() if m.user_id == "bob"} == {parents[0], new_parent[0]}


def layout_block_texts(data, user, memory_ids):
    with MemoryStore(data / "memories.sqlite") as store:
        by_id = {m.id: m.text for m in store.list(user, page_size=100).items}
    return [by_id[m] for m in memory_ids]


def test_knowledge_resident_once_children_hold_their_own_tokens(tmp_path, tiny_handle):
    """Views, not copies: the knowledge item's K/V are resident once; a child in a tier holds its own tokens'
    K/V only (its block costs its own bytes), `get` attaches the resident parent, and a request's injection
    joins them into the request's own cache (one copy, not stored), with K/V identical to a full prefill's."""
    import torch

    from kvmem.kv import inject
    from kvmem.kv.blocks import BlockBuilder

    layout = PromptLayout(tiny_handle.tokenizer, knowledge=KNOWLEDGE)
    k = len(layout.knowledge_ids)
    store = kv_store(tmp_path / "shared", tiny_handle)
    full_store = kv_store(tmp_path / "full", tiny_handle)
    builder = BlockBuilder(tiny_handle, layout, store)
    full = BlockBuilder(tiny_handle, layout, full_store, share_knowledge=False)
    users = {
        "alice": ["Alice lives in Lisbon."],
        "bob": ["Bob collects stamps.", "Bob is 40."],
        "carol": ["C."],
    }
    built = {
        u: builder.build(u, texts, [f"{u}-{i}" for i in range(len(texts))]) for u, texts in users.items()
    }
    whole = {u: full.build(u, texts, [f"{u}-{i}" for i in range(len(texts))]) for u, texts in users.items()}

    for fresh in (False, True):  # as built, then loaded from disk by a new store
        s = kv_store(tmp_path / "shared", tiny_handle) if fresh else store
        items = {u: s.get(b.item_id) for u, b in built.items()}
        parent = items["alice"].parent
        assert parent is not None and parent.num_tokens == k and parent.own_start == 0
        for u, item in items.items():
            assert item.parent is parent  # one resident parent, shared by reference
            assert item.kv.shape[3] == item.num_tokens - k and item.own_start == k
            assert built[u].num_bytes == item.resident_bytes == item.meta.stored_bytes
            assert built[u].shared_tokens == k
            assert whole[u].num_bytes == item.meta.num_bytes  # a plain item costs every token's bytes
            # the tier holds the child bare: no second reference to the parent's tensor
            assert s._resident["device"][item.item_id].parent is None
        # the device tier counts the knowledge once and each child's own bytes
        assert s.size_info().device.num_bytes == parent.resident_bytes + sum(
            i.resident_bytes for i in items.values()
        )
        assert s.size_info().disk.num_bytes == s.size_info().device.num_bytes

        # injection: the parent's K/V then the child's own, exactly, in a cache the request owns; greedy tokens
        # identical to a full prefill's; nothing stored changes
        prompt = layout.prompt(users["bob"], [], [{"role": "user", "content": "Hi"}])
        before = (items["bob"].kv.clone(), parent.kv.clone())
        injection = inject(items["bob"], prompt.ids)
        assert injection.reused_tokens == items["bob"].num_tokens
        for i, layer in enumerate(injection.cache.layers):
            for j, t in enumerate((layer.keys[0], layer.values[0])):
                assert torch.equal(t[:, :k], parent.kv[i, j]) and torch.equal(t[:, k:], items["bob"].kv[i, j])
            assert layer.keys.untyped_storage().data_ptr() != parent.kv.untyped_storage().data_ptr()
        ours = list(
            generate(tiny_handle.model, prompt.ids, item=items["bob"], sampling=Sampling(max_new_tokens=6))
        )
        assert ours == reference_tokens(tiny_handle.model, list(prompt.ids), 6, "cpu")
        assert torch.equal(before[0], items["bob"].kv) and torch.equal(before[1], parent.kv)
        # an injection within the knowledge is a view of the parent (no copy at all)
        head = inject(items["bob"], layout.knowledge_ids + (1,))
        assert (
            head.cache.layers[0].keys.untyped_storage().data_ptr() == parent.kv.untyped_storage().data_ptr()
        )
