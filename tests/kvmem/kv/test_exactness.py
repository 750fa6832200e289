"""Invariant 1 (exactness) and 2 (immutability): KV injection gives the same greedy tokens as a full
prefill of the same ids, computed independently by transformers' own `generate`, and never writes the
stored tensors."""

from __future__ import annotations

import dataclasses
import hashlib

import pytest
import torch

from benchmarks.ttft.ttft_grid import reference_tokens
from kvmem.kv import GenerationStats, PromptLayout, Sampling, build_item, generate
from kvmem.models import compiled
from tests.conftest import synthetic_memories

QUERIES = [
    [{"role": "user", "content": "What is the name of my cat?"}],
    [
        {
            "role": "user",
            "content": "Plan my week. " + " ".join(f"Item {i}: remember the budget." for i in range(20)),
        }
    ],
    [
        {"role": "user", "content": "I just got back from hiking."},
        {"role": "assistant", "content": "That sounds lovely! Where did you go?"},
        {"role": "system", "content": "Answer in one sentence."},
        {"role": "user", "content": "Which city did I say I wanted to visit?"},
    ],
]


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def reference_greedy(model, ids, max_new_tokens: int) -> list[int]:
    """Full prefill + decode by transformers' generate (not our loop)."""
    return reference_tokens(model, list(ids), max_new_tokens, "cpu")


def check_exact(handle, block_tokens: int, max_new_tokens: int, queries=QUERIES) -> None:
    layout = PromptLayout(handle.tokenizer)
    memories = synthetic_memories(block_tokens, handle.tokenizer, seed=block_tokens)
    block_ids = layout.block_ids(memories)
    item = build_item(handle, block_ids, user_id="alice", memory_ids=[f"m{i}" for i in range(len(memories))])
    before = _digest(item.kv)
    for messages in queries:
        prompt = layout.prompt(memories, [], messages)
        assert prompt.ids[: prompt.block_len] == tuple(block_ids)
        stats = GenerationStats()
        ours = list(
            generate(
                handle.model,
                prompt.ids,
                item=item,
                sampling=Sampling(max_new_tokens=max_new_tokens),
                stats=stats,
            )
        )
        assert stats.reused_tokens == len(block_ids)
        assert stats.prefilled_tokens == len(prompt.ids) - len(block_ids)
        assert ours == reference_greedy(handle.model, list(prompt.ids), max_new_tokens)
    assert _digest(item.kv) == before, "the stored KV tensors were modified by generation"


@pytest.mark.parametrize("block_tokens", [500, 2000, 6000])
def test_tiny_llama_injection_is_token_identical(tiny_handle, block_tokens):
    check_exact(tiny_handle, block_tokens, max_new_tokens=16)


@pytest.mark.slow
@pytest.mark.parametrize("block_tokens", [500, 2000, 6000])
def test_default_model_injection_is_token_identical(default_handle, block_tokens):
    check_exact(default_handle, block_tokens, max_new_tokens=12)


@pytest.mark.slow
def test_compiled_model_injection_is_token_identical(tiny_handle):
    """The compiled forward (ttft_grid --compile) on the zero-copy injected cache: the same greedy tokens as
    eager generate, over blocks of two lengths and three queries, and the stored tensors untouched."""
    handle = dataclasses.replace(tiny_handle, model=compiled(tiny_handle.model))
    for block_tokens in (500, 2000):
        check_exact(handle, block_tokens, max_new_tokens=8)


def test_prompt_equal_to_block_still_prefills_one_token(tiny_handle):
    layout = PromptLayout(tiny_handle.tokenizer)
    ids = layout.block_ids(["I have a cat named Miso."])
    item = build_item(tiny_handle, ids, user_id="alice")
    stats = GenerationStats()
    ours = list(generate(tiny_handle.model, ids, item=item, sampling=Sampling(max_new_tokens=5), stats=stats))
    assert (stats.reused_tokens, stats.prefilled_tokens) == (len(ids) - 1, 1)
    assert ours == reference_greedy(tiny_handle.model, ids, 5)


def test_longer_item_reuses_only_common_prefix(tiny_handle):
    """A block built for [m1, m2, m3] serves a prompt whose block is [m1, m2] (shared token prefix only)."""
    layout = PromptLayout(tiny_handle.tokenizer)
    mems = ["I live in Lisbon.", "My sister is a teacher.", "I am allergic to peanuts."]
    item = build_item(tiny_handle, layout.block_ids(mems), user_id="alice")
    prompt = layout.prompt(mems[:2], [], [{"role": "user", "content": "Where do I live?"}])
    stats = GenerationStats()
    ours = list(
        generate(tiny_handle.model, prompt.ids, item=item, sampling=Sampling(max_new_tokens=6), stats=stats)
    )
    assert stats.reused_tokens == len(layout.block_ids(mems[:2]))
    assert ours == reference_greedy(tiny_handle.model, list(prompt.ids), 6)


def test_concurrent_requests_share_one_item_without_interference(tiny_handle):
    """Two requests interleave decode steps over the same stored item; each equals its own reference."""
    layout = PromptLayout(tiny_handle.tokenizer)
    mems = synthetic_memories(300, tiny_handle.tokenizer, seed=7)
    item = build_item(tiny_handle, layout.block_ids(mems), user_id="alice")
    before = _digest(item.kv)
    p1 = layout.prompt(mems, [], QUERIES[0]).ids
    p2 = layout.prompt(mems, [], QUERIES[2]).ids
    g1 = generate(tiny_handle.model, p1, item=item, sampling=Sampling(max_new_tokens=8))
    g2 = generate(tiny_handle.model, p2, item=item, sampling=Sampling(max_new_tokens=8))
    out1, out2 = [], []
    for a, b in zip(g1, g2, strict=True):
        out1.append(a)
        out2.append(b)
    assert out1 == reference_greedy(tiny_handle.model, list(p1), 8)
    assert out2 == reference_greedy(tiny_handle.model, list(p2), 8)
    assert _digest(item.kv) == before


def test_appended_block_extends_the_stored_prefix_and_stays_exact(tiny_handle, tmp_path):
    """Appending memories prefills only the new ones over the stored block (its K/V reused bit for bit)."""
    from kvmem.kv import KVStoreConfig, TieredKVStore
    from kvmem.kv.blocks import BlockBuilder

    layout = PromptLayout(tiny_handle.tokenizer)
    store = TieredKVStore(KVStoreConfig(directory=str(tmp_path)), tiny_handle.fingerprint)
    builder = BlockBuilder(tiny_handle, layout, store)
    mems = synthetic_memories(400, tiny_handle.tokenizer, seed=3)
    ids = [f"m{i}" for i in range(len(mems))]
    first = builder.build("alice", mems[:-2], ids[:-2])
    old = store.get(first.item_id)
    grown = builder.build("alice", mems, ids)
    new = store.get(grown.item_id)
    assert grown.built and new.num_tokens > old.num_tokens
    assert torch.equal(new.kv[:, :, :, : old.num_tokens], old.kv)
    prompt = layout.prompt(mems, [], QUERIES[0])
    ours = list(generate(tiny_handle.model, prompt.ids, item=new, sampling=Sampling(max_new_tokens=8)))
    assert ours == reference_greedy(tiny_handle.model, list(prompt.ids), 8)


@pytest.mark.parametrize("knowledge", [False, True])
@pytest.mark.parametrize("tier", ["host", "disk"])
def test_a_cut_block_is_the_stored_prefix_and_its_rebuild_prefills_only_the_rest(
    tiny_handle, tmp_path, knowledge, tier
):
    """A block whose third memory changed is cut after its second, from its own K/V (no prefill): the cut's
    ids are the layout's for those two memories, its K/V the block's first tokens' bit for bit, it serves
    the same greedy tokens as a full prefill, and the rebuild of the changed block prefills over it. From RAM
    or from the file alone (a new store: no tier holds it, and reading it moves nothing into one)."""
    from kvmem.kv import KVStoreConfig, TieredKVStore
    from kvmem.kv.blocks import BlockBuilder

    facts = ["Our shop opens at 9am.", "Returns are accepted within 30 days."] if knowledge else []
    layout = PromptLayout(tiny_handle.tokenizer, knowledge=facts)
    store = TieredKVStore(KVStoreConfig(directory=str(tmp_path)), tiny_handle.fingerprint)
    builder = BlockBuilder(tiny_handle, layout, store)
    mems = ["Alice lives in Lisbon.", "Alice has a cat named Miso.", "Alice's locker code is 4417."]
    ids = ["m0", "m1", "m2"]
    whole = builder.build("alice", mems, ids)
    old = store.get(whole.item_id)
    if tier == "disk":
        store = TieredKVStore(KVStoreConfig(directory=str(tmp_path)), tiny_handle.fingerprint)
        builder = BlockBuilder(tiny_handle, layout, store)
    cut = builder.cut(whole.item_id, ids[:2], mems[:2])
    assert tier != "disk" or store.tier_of(whole.item_id) == "disk"  # the read kept no copy in a tier
    assert cut.built and cut.memory_ids == ("m0", "m1")
    assert cut.token_ids == tuple(layout.block_ids(mems[:2])) == old.token_ids[: cut.num_tokens]
    assert cut.shared_tokens == (len(layout.knowledge_ids) if knowledge else 0)
    item = store.get(cut.item_id)
    n = cut.num_tokens
    assert torch.equal(item.kv_range(0, n), old.kv_range(0, n))
    prompt = layout.prompt(mems[:2], ["Alice's locker code is 9921."], QUERIES[0])
    ours = list(generate(tiny_handle.model, prompt.ids, item=item, sampling=Sampling(max_new_tokens=8)))
    assert ours == reference_greedy(tiny_handle.model, list(prompt.ids), 8)
    again = builder.cut(whole.item_id, ids[:2], mems[:2])  # content-addressed: found, not stored twice
    assert not again.built and again.item_id == cut.item_id
    store.remove(whole.item_id)
    pending = builder.lookup("alice", [*mems[:2], "Alice's locker code is 9921."], ["m0", "m1", "m2b"])
    assert pending.prefix is not None and pending.prefix.item_id == cut.item_id
    with pytest.raises(ValueError, match="not a proper prefix"):
        builder.cut(cut.item_id, ["m1"], mems[1:2])
    assert builder.cut(whole.item_id, ids[:1], mems[:1]) is None  # the item is gone
