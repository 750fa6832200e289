"""Micro-benchmarks of the hot small operations (pytest-benchmark; not part of the default test run):

    python -m pytest benchmarks/engine/micro --benchmark-only --benchmark-json out/micro.json

plan read, KV item load from disk vs recompute, plaintext search, prompt layout.
"""

from __future__ import annotations

import pytest

from benchmarks.load.http_client import memory_texts


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from kvmem.models import provision

    return AutoTokenizer.from_pretrained(str(provision()))


@pytest.fixture(scope="module")
def tiny(tokenizer):
    from kvmem.models import handle_for
    from tests.conftest import make_tiny_llama

    return handle_for(make_tiny_llama(len(tokenizer)), tokenizer, model_id="tiny-llama")


def test_plan_read(benchmark, tmp_path):
    """The server's plan read: `Scheduler.get` of the scheduler `create_app` builds (fake backend), one user
    with a published block."""
    from kvmem.text import HashEmbedder, MemoryStore
    from scheduler.wiring import make_scheduler
    from serving.backends.fake import FakeBackend
    from serving.config import ServingConfig

    store = MemoryStore(tmp_path / "m.sqlite", embedder=HashEmbedder())
    config = ServingConfig(data_dir=tmp_path, backend="fake", block_token_budget=4096)
    scheduler = make_scheduler(config, store, FakeBackend())
    scheduler.start(thread=False)
    try:
        store.add("alice", texts=memory_texts(8, 20))
        scheduler.flush()
        assert len(scheduler.get("alice").block.memory_ids) == 8
        benchmark(scheduler.get, "alice")
    finally:
        scheduler.stop()


def test_planbook_read(benchmark):
    """The PlanBook read under `Scheduler.get` (a dict read of an immutable snapshot), 1,000 users published."""
    from scheduler.plan import BlockPlan, Plan, PlanBook

    book = PlanBook()
    for u in range(1000):
        block = BlockPlan(f"item-{u}", tuple(f"m{u}-{k}" for k in range(8)), ("t",) * 8, 2000, 1 << 20)
        book.publish(Plan(user_id=f"user-{u}", block=block, version=1))
    plan = benchmark(book.get, "user-500")
    assert plan.block is not None and plan.block.item_id == "item-500"


@pytest.mark.parametrize("block_tokens", [500, 2000])
def test_kv_load_from_disk(benchmark, tmp_path, tiny, block_tokens):
    from benchmarks.ttft.memos_grid import memories_for
    from kvmem.kv import PromptLayout, build_item
    from kvmem.kv.io import load_item, save_item

    layout = PromptLayout(tiny.tokenizer)
    item = build_item(tiny, layout.block_ids(memories_for(layout, block_tokens, seed=1)), user_id="u")
    save_item(item, tmp_path)
    benchmark(load_item, tmp_path, item.item_id, tiny.fingerprint)


@pytest.mark.parametrize("block_tokens", [500, 2000])
def test_kv_recompute(benchmark, tiny, block_tokens):
    from benchmarks.ttft.memos_grid import memories_for
    from kvmem.kv import PromptLayout, build_item

    layout = PromptLayout(tiny.tokenizer)
    ids = layout.block_ids(memories_for(layout, block_tokens, seed=1))
    benchmark(build_item, tiny, ids, user_id="u")


@pytest.mark.parametrize("embedder", ["hash", "default"])
def test_store_search(benchmark, tmp_path, embedder):
    from kvmem.text import HashEmbedder, MemoryStore

    store = MemoryStore(tmp_path / "m.sqlite", embedder=HashEmbedder() if embedder == "hash" else None)
    store.add("alice", texts=memory_texts(500, 15, seed=2))
    store.add("bob", texts=memory_texts(500, 15, seed=3))
    hits = benchmark(store.search, "alice", "kitchen renovation budget", top_k=10)
    assert hits and all(h.memory.user_id == "alice" for h in hits)


@pytest.mark.parametrize("block_words", [40, 190])
def test_prompt_layout(benchmark, tokenizer, block_words):
    """Per request, serving lays out the whole prompt, block texts included (190 words: http_ttft's ~1.7k-token
    block)."""
    from kvmem.kv import PromptLayout

    layout = PromptLayout(tokenizer)
    block, text = memory_texts(8, block_words), memory_texts(4, 20, seed=5)
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "What should I plan next month?"},
    ]
    prompt = benchmark(layout.prompt, block, text, messages)
    assert prompt.block_len == len(layout.block_ids(block))
