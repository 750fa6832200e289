"""The server over the real default model (transformers backend) and its own scheduler, through the official
openai client: the scheduler's block is served from KV (cached_tokens), and an item corrupted on disk while
the server runs means a successful answer from a full prefill with the very same tokens (invariant 6)."""

from __future__ import annotations

import pytest
from openai import OpenAI

from kvmem.kv.io import item_paths
from scheduler.wiring import make_scheduler
from serving.backends.transformers.backend import TransformersBackend, TransformersBackendConfig
from serving.config import ServingConfig
from serving.http.app import create_app
from tests.serving.conftest import TickClock, live_server, wait_for

MEMORIES = [
    "I live in Lisbon with my sister.",
    "My dog is a golden retriever called Miso.",
    "I am allergic to peanuts.",
]
QUESTION = [{"role": "user", "content": "What is my dog called?"}]


@pytest.fixture(scope="module")
def real_server(tmp_path_factory, default_model_dir):
    import kvmem.text

    data = tmp_path_factory.mktemp("real")
    # RAM tiers of 0 bytes: every request reads the item from disk, verified, so disk corruption is seen.
    backend = TransformersBackend(
        TransformersBackendConfig(model=str(default_model_dir), data_dir=str(data), host_kv_bytes=0)
    )
    config = ServingConfig(
        data_dir=data, backend="transformers", auth=False, model=str(default_model_dir), store_turns=False
    )
    store = kvmem.text.MemoryStore(data / "memories.sqlite")
    scheduler = make_scheduler(config, store, backend, clock=TickClock())
    scheduler.start(thread=False)  # its tasks run in the test's thread: scheduler.flush()
    app = create_app(config, backend=backend, store=store, scheduler=scheduler)
    with live_server(app) as url:
        wait_for(backend.is_ready, "model load", tries=3000)
        yield url, backend, store, scheduler
    scheduler.stop()


@pytest.mark.slow
def test_kv_answer_then_corrupt_item_falls_back_to_identical_text_answer(real_server):
    url, backend, store, scheduler = real_server
    memories = store.add("alice", texts=MEMORIES)
    scheduler.flush()
    block = scheduler.get("alice").block
    # the scheduler's first block: every memory (the cap is 2048 tokens), longest unchanged first
    assert block.memory_ids == tuple(m.id for m in memories)
    assert block.texts == tuple(MEMORIES)
    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)

    def ask():
        return client.chat.completions.create(
            model=backend.model_id, messages=QUESTION, user="alice", temperature=0, max_tokens=16
        )

    first = ask()
    block_len = backend.layout_prompt(block.texts, [], []).block_len
    assert block.num_tokens == block_len == len(block.token_ids)
    assert first.usage.prompt_tokens_details.cached_tokens == block_len
    assert {m["tier"] for m in first.model_extra["memory"]["used"]} == {"kv"}

    tensor_path, _ = item_paths(backend.store.directory, block.item_id)
    raw = bytearray(tensor_path.read_bytes())
    raw[-64] ^= 0xFF
    tensor_path.write_bytes(bytes(raw))

    second = ask()
    assert second.usage.prompt_tokens_details.cached_tokens == 0
    assert {m["tier"] for m in second.model_extra["memory"]["used"]} == {"text"}
    assert second.usage.prompt_tokens == first.usage.prompt_tokens
    assert (
        second.choices[0].message.content == first.choices[0].message.content
    )  # same ids, same greedy tokens
    assert first.choices[0].message.content  # the model did answer


@pytest.mark.slow
def test_streaming_equals_non_streaming_and_limits_hold(real_server):
    url, backend, store, scheduler = real_server
    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    q = [{"role": "user", "content": "Tell me a short story about a dog."}]
    full = client.chat.completions.create(
        model=backend.model_id, messages=q, user="bob", temperature=0, max_tokens=10
    )
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 10
    chunks = client.chat.completions.create(
        model=backend.model_id,
        messages=q,
        user="bob",
        temperature=0,
        max_tokens=10,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, usage = [], None
    for chunk in chunks:
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
        else:
            usage = chunk.usage
    assert "".join(pieces) == full.choices[0].message.content
    assert usage.completion_tokens == 10 and usage.prompt_tokens == full.usage.prompt_tokens
    words = full.choices[0].message.content.split()
    stop = words[2]
    cut = client.chat.completions.create(
        model=backend.model_id, messages=q, user="bob", temperature=0, max_tokens=10, stop=[stop]
    )
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == full.choices[0].message.content.split(stop)[0]
