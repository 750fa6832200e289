"""The vLLM backend on real vLLM (CPU, fp32, eager) and the real default model, one engine for the module.

Exactness: a block injected from its KV item, the same block resident in vLLM's prefix cache, a cold prefill,
a plain prefix hit and the transformers backend give the same greedy tokens. Isolation: the cache salt keeps
users (and a user's old blocks) apart. Fallback: a corrupt item is a full prefill with the same answer. Then
streaming, stops, seeds, aborts, 429s, and the official openai client against the app with this backend.
"""

from __future__ import annotations

import asyncio
import logging
import time

import httpx
import pytest

pytest.importorskip("vllm")

from openai import OpenAI  # noqa: E402

from kvmem.kv import Sampling, generate  # noqa: E402
from kvmem.kv.io import item_paths  # noqa: E402
from serving.backends.base import (  # noqa: E402
    BlockNotFound,
    GenerationRequest,
    GenerationResult,
    QueueFull,
    SamplingParams,
    TokenDelta,
)
from serving.backends.transformers.backend import TransformersBackend, TransformersBackendConfig  # noqa: E402
from serving.backends.vllm import connector as vllm_connector  # noqa: E402
from serving.backends.vllm.backend import VllmBackend, VllmBackendConfig  # noqa: E402
from tests.conftest import synthetic_memories  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

QUESTION = [{"role": "user", "content": "What did I mention on day 3? Answer in one sentence."}]
GREEDY = SamplingParams(max_new_tokens=32, temperature=0.0)


@pytest.fixture(scope="module")
def backend(tmp_path_factory, default_model_dir):
    # RAM tier of 0 bytes: every request reads its item from disk, verified, so disk corruption is seen.
    vb = VllmBackend(
        VllmBackendConfig(
            model=str(default_model_dir),
            data_dir=str(tmp_path_factory.mktemp("vllm-data")),
            max_queue=2,
            host_kv_bytes=0,
        )
    )
    vb.load()
    yield vb
    asyncio.run(vb.aclose())


@pytest.fixture(scope="module")
def memories(backend):
    return synthetic_memories(600, backend.handle.tokenizer, seed=3)


async def _run(backend, req, is_disconnected=None):
    ids, text, result = [], [], None
    async for item in backend.stream(req, is_disconnected):
        if isinstance(item, TokenDelta):
            ids.extend(item.token_ids)
            text.append(item.text)
        else:
            result = item
    return ids, "".join(text), result


def run(backend, user, prompt, item_id, sampling=GREEDY, request_id=None, session_id=None):
    req = GenerationRequest(
        request_id or f"req-{time.monotonic_ns()}", user, prompt, item_id, sampling, session_id=session_id
    )
    return asyncio.run(_run(backend, req))


def wait_idle(backend) -> None:
    for _ in range(500):  # bounded: 10 s at most
        engine = backend._engine.engine
        if (
            backend.queue_depth == 0
            and engine.get_num_unfinished_requests() == 0
            and not len(vllm_connector.ITEM_SHELF)
        ):
            return
        time.sleep(0.02)
    raise AssertionError("the backend did not go idle")


def test_injected_resident_cold_prefix_hit_and_transformers_give_the_same_greedy_tokens(
    backend, memories, default_model_dir
):
    built = backend.build_block("alice", memories)  # also makes it resident (prewarm)
    prompt = backend.layout_prompt(memories, [], QUESTION, built.token_ids)
    block_len, size = prompt.block_len, backend._engine.engine.vllm_config.cache_config.block_size
    assert built.num_tokens == block_len and prompt.ids[:block_len] == built.token_ids

    resident = run(backend, "alice", prompt, built.item_id)  # whole blocks resident, the tail injected
    assert backend.reset_prefix_cache()
    injected = run(backend, "alice", prompt, built.item_id)  # nothing resident: all of it injected
    assert backend.reset_prefix_cache()
    cold = run(backend, "cold-user", prompt, None)  # no item: vLLM prefills everything
    hit = run(backend, "cold-user", prompt, None)  # the same prompt again: vLLM's own prefix cache

    item = backend.store.get(built.item_id)
    hf_ids = list(
        generate(
            backend.handle.model,
            prompt.ids,
            item=item,
            sampling=Sampling(max_new_tokens=32),
            stop_token_ids=backend._eos,
        )
    )
    tb = TransformersBackend(
        TransformersBackendConfig(model=str(default_model_dir), data_dir=backend.config.data_dir)
    )
    tb.load()
    try:
        tf = run(tb, "alice", prompt, built.item_id)
    finally:
        asyncio.run(tb.aclose())

    assert resident[0] == injected[0] == cold[0] == hit[0] == hf_ids == tf[0]
    assert resident[1] == injected[1] == cold[1] == hit[1] == tf[1] and len(tf[1]) > 0
    results = {"resident": resident[2], "injected": injected[2], "cold": cold[2], "hit": hit[2]}
    assert {k: r.cached_tokens for k, r in results.items()} == {
        "resident": block_len,
        "injected": block_len,
        "cold": 0,
        "hit": (len(prompt.ids) - 1) // size * size,
    }
    assert tf[2].cached_tokens == block_len
    assert {r.completion_tokens for r in results.values()} == {tf[2].completion_tokens}
    assert {r.finish_reason for r in results.values()} == {tf[2].finish_reason}
    assert all(r.kv_fallback_reason is None for r in results.values())
    wait_idle(backend)


def test_the_salt_keeps_users_and_old_blocks_apart(backend, memories):
    built = backend.build_block("alice", memories)  # resident for alice under her item's salt
    prompt = backend.layout_prompt(memories, [], QUESTION, built.token_ids)
    again = run(backend, "alice", prompt, built.item_id)
    assert again[2].cached_tokens == prompt.block_len
    # bob has byte-identical memories, so the very same prompt ids, but no block yet: nothing of alice's
    bob_cold = run(backend, "bob", prompt, None)
    assert bob_cold[2].cached_tokens == 0
    # alice's item named in another user's request is refused; nothing is reused
    eve_wrong = run(backend, "eve", prompt, built.item_id)
    assert (eve_wrong[2].cached_tokens, eve_wrong[2].kv_fallback_reason) == (0, "wrong_user")
    # bob's own block: another item (the user is in its address), injected for him
    bob_built = backend.build_block("bob", memories)
    assert bob_built.item_id != built.item_id and bob_built.token_ids == built.token_ids
    bob_kv = run(backend, "bob", prompt, bob_built.item_id)
    assert bob_kv[2].cached_tokens == prompt.block_len
    # alice without that block item (her plan changed): her resident block is not reachable
    alice_other = run(backend, "alice", prompt, None)
    assert alice_other[2].cached_tokens == 0
    assert again[0] == bob_cold[0] == eve_wrong[0] == bob_kv[0] == alice_other[0]
    wait_idle(backend)


def test_a_corrupt_item_is_a_full_prefill_with_the_same_answer_and_a_log_line(backend, memories, caplog):
    texts = memories[:10]
    built = backend.build_block("carol", texts)
    prompt = backend.layout_prompt(texts, [], QUESTION, built.token_ids)
    assert backend.reset_prefix_cache()
    good = run(backend, "carol", prompt, built.item_id)
    assert (good[2].cached_tokens, good[2].kv_fallback_reason) == (prompt.block_len, None)
    assert backend.reset_prefix_cache()
    tensor_path, _ = item_paths(backend.store.directory, built.item_id)
    raw = bytearray(tensor_path.read_bytes())
    raw[-64] ^= 0xFF
    tensor_path.write_bytes(bytes(raw))
    dropped: list[tuple[str, str, str]] = []
    unsubscribe = backend.subscribe_dropped(lambda *args: dropped.append(args))
    with caplog.at_level(logging.WARNING, logger="serving.backends.vllm.backend"):
        bad = run(backend, "carol", prompt, built.item_id)
    unsubscribe()
    assert (bad[2].cached_tokens, bad[2].kv_fallback_reason) == (0, "corrupt")
    assert bad[0] == good[0] and bad[1] == good[1]
    assert any("KV fallback" in r.message and built.item_id in r.getMessage() for r in caplog.records)
    assert not backend.has_block(built.item_id)  # dropped, so the next build replaces it
    assert dropped == [(built.item_id, "carol", "corrupt")]
    wait_idle(backend)


def test_forget_removes_the_blocks_built_from_a_memory(backend, memories):
    one = backend.build_block("gina", memories[:2], ["m1", "m2"])
    two = backend.build_block("gina", memories[:3], ["m1", "m2", "m3"])
    other = backend.build_block("hal", memories[:3], ["m1", "m2", "m3"])
    assert backend.forget("gina", ["m3"]) == [two.item_id]
    assert (backend.has_block(one.item_id), backend.has_block(two.item_id)) == (True, False)
    assert backend.forget("gina") == [one.item_id]
    assert backend.has_block(other.item_id)  # another user's blocks stay
    wait_idle(backend)


def test_a_block_item_that_is_not_stored_is_refused_before_anything_is_generated(
    backend, memories, monkeypatch
):
    """Issue 27 item 5c under vLLM: the request's block item was dropped since it was prepared (a delete's
    cascade) while vLLM still holds the block in its prefix cache under the item's salt: the backend raises
    BlockNotFound before its first item and submits nothing (serving prepares the request again) instead of
    prefilling the prompt's block texts, maybe a deleted memory's; its admission slot is released. Before, vLLM
    served it from its prefix cache with no fallback at all."""
    texts = memories[:3]
    block = backend.build_block("gone", texts, ["g1", "g2", "g3"])  # resident in vLLM too (prewarm)
    prompt = backend.layout_prompt(texts, [], QUESTION, block.token_ids)
    req = GenerationRequest("gone-req", "gone", prompt, block.item_id, GREEDY)
    assert backend.forget("gone", ["g2"]) == [block.item_id]
    submitted: list[str] = []
    submit = backend._submit

    def recording_submit(request_id, *args, **kwargs):
        submitted.append(request_id)
        return submit(request_id, *args, **kwargs)

    monkeypatch.setattr(backend, "_submit", recording_submit)
    with pytest.raises(BlockNotFound) as gone:
        asyncio.run(_run(backend, req))
    assert gone.value.item_id == block.item_id
    assert submitted == [] and backend.queue_depth == 0
    wait_idle(backend)


def test_stop_strings_max_tokens_and_seeds(backend):
    prompt = backend.layout_prompt(
        [], [], [{"role": "user", "content": "Write a long story about a dragon who loves the sea."}]
    )
    full = run(backend, "dan", prompt, None, SamplingParams(max_new_tokens=24, temperature=0.0))
    assert full[2].finish_reason == "length" and full[2].completion_tokens == 24 == len(full[0])
    stop = full[1][len(full[1]) // 2 : len(full[1]) // 2 + 3]
    stopped = run(
        backend, "dan", prompt, None, SamplingParams(max_new_tokens=24, temperature=0.0, stop=(stop,))
    )
    assert stopped[2].finish_reason == "stop"
    assert stopped[1] == full[1][: full[1].index(stop)]
    assert stopped[0] == full[0][: len(stopped[0])] and stopped[2].completion_tokens == len(stopped[0])
    seeded = SamplingParams(max_new_tokens=16, temperature=0.9, top_p=0.9, seed=1234)
    first = run(backend, "dan", prompt, None, seeded)
    second = run(backend, "dan", prompt, None, seeded)
    assert first[0] == second[0] and len(first[0]) == 16
    assert first[0] != full[0][:16]  # sampled, not greedy: the temperature is honoured
    other = run(backend, "dan", prompt, None, SamplingParams(max_new_tokens=16, temperature=0.9, seed=4321))
    assert other[0] != first[0]  # another seed, other tokens
    # top_p so small that only the most likely token is left: greedy whatever the temperature and seed
    nucleus = run(
        backend, "dan", prompt, None, SamplingParams(max_new_tokens=16, temperature=0.9, top_p=1e-6)
    )
    assert nucleus[0] == full[0][:16]
    wait_idle(backend)


def test_a_client_leaving_aborts_the_request_and_admission_is_bounded(backend):
    prompt = backend.layout_prompt([], [], [{"role": "user", "content": "Tell me a long story."}])
    long = GenerationRequest(
        "long", "erin", prompt, None, SamplingParams(max_new_tokens=2000, temperature=0.0)
    )

    async def leave_after_first_token():
        stream = backend.stream(long)
        first = await anext(stream)
        await stream.aclose()  # what the server does when the client disconnects
        return first

    assert isinstance(asyncio.run(leave_after_first_token()), TokenDelta)
    wait_idle(backend)  # vLLM has no unfinished request left: it was aborted, not run to 2,000 tokens

    async def gone() -> bool:
        return True

    ids, _, result = asyncio.run(_run(backend, long, gone))  # the disconnect poll stops it too
    assert result is None and len(ids) < 2000
    wait_idle(backend)

    short = SamplingParams(max_new_tokens=4, temperature=0.0)

    async def three_at_once():  # max_queue is 2
        a = backend.stream(GenerationRequest("a", "erin", prompt, None, short))
        b = backend.stream(GenerationRequest("b", "erin", prompt, None, short))
        await anext(a), await anext(b)
        with pytest.raises(QueueFull):
            await anext(backend.stream(GenerationRequest("c", "erin", prompt, None, short)))
        rest_a, rest_b = [x async for x in a], [x async for x in b]
        return rest_a[-1], rest_b[-1]

    last_a, last_b = asyncio.run(three_at_once())
    assert isinstance(last_a, GenerationResult) and isinstance(last_b, GenerationResult)
    wait_idle(backend)
    assert len(run(backend, "erin", prompt, None, short)[0]) == 4  # the slots are free again


def test_the_openai_client_against_the_app_on_the_vllm_backend(backend, tmp_path):
    import kvmem.text
    from scheduler.wiring import make_scheduler
    from serving.config import ServingConfig
    from serving.http.app import create_app
    from tests.serving.conftest import TickClock, live_server

    texts = ["I live in Lisbon with my sister.", "My dog is a golden retriever called Miso."]
    config = ServingConfig(
        data_dir=tmp_path, backend="vllm", auth=False, model=backend.model_id, store_turns=False
    )
    store = kvmem.text.MemoryStore(tmp_path / "memories.sqlite")
    scheduler = make_scheduler(config, store, backend, clock=TickClock())
    scheduler.start(thread=False)
    app = create_app(config, backend=backend, store=store, scheduler=scheduler)
    try:
        store.add("frank", texts=texts)
        scheduler.flush()  # builds frank's block through the backend (and makes it resident)
        block = scheduler.get("frank").block
        assert block is not None and block.texts == tuple(texts)  # longest unchanged first
        with live_server(app) as url:
            client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
            question = [{"role": "user", "content": "What is my dog called?"}]
            out = client.chat.completions.create(
                model=backend.model_id, messages=question, user="frank", temperature=0, max_tokens=16
            )
            assert out.usage.prompt_tokens_details.cached_tokens == block.num_tokens
            assert {m["tier"] for m in out.model_extra["memory"]["used"]} == {"kv"}
            assert out.choices[0].message.content
            chunks = list(
                client.chat.completions.create(
                    model=backend.model_id,
                    messages=question,
                    user="frank",
                    temperature=0,
                    max_tokens=16,
                    stream=True,
                    stream_options={"include_usage": True},
                )
            )
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert text == out.choices[0].message.content
            assert chunks[-1].usage.prompt_tokens_details.cached_tokens == block.num_tokens
            assert httpx.get(f"{url}/health").json()["backend"] == "vllm"
    finally:
        scheduler.stop()
    wait_idle(backend)


def test_cached_tokens_count_the_block_only_not_vllms_hits_past_it(backend, memories, default_model_dir):
    # API.md: cached_tokens counts prompt tokens served from activation memory. vLLM's own count also takes
    # the whole blocks of the rest of the prompt it has cached (a conversation, a repeated question): those
    # are not memory, and the transformers backend does not count them either.
    texts = memories[:10]
    built = backend.build_block("ivan", texts)
    question = [{"role": "user", "content": " ".join(["Tell me about the harbour and its boats."] * 60)}]
    prompt = backend.layout_prompt(texts, [], question, built.token_ids)
    size = backend._engine.engine.vllm_config.cache_config.block_size
    # the second request's prefix-cache hit in vLLM's count: every whole block before the last token,
    # at least two blocks past the memory block
    assert (len(prompt.ids) - 1) // size * size >= prompt.block_len + 2 * size
    short = SamplingParams(max_new_tokens=4, temperature=0.0)
    first = run(backend, "ivan", prompt, built.item_id, short)
    second = run(backend, "ivan", prompt, built.item_id, short)
    assert (first[2].cached_tokens, second[2].cached_tokens) == (prompt.block_len, prompt.block_len)
    assert (first[2].kv_fallback_reason, second[2].kv_fallback_reason) == (None, None)
    assert first[0] == second[0] and len(first[0]) == 4
    # in a session (X-Session-Id) the conversation's kept KV counts, as on the transformers backend: vLLM's count
    third = run(backend, "ivan", prompt, built.item_id, short, session_id="s1")
    assert third[2].cached_tokens == (len(prompt.ids) - 1) // size * size and third[0] == first[0]
    tb = TransformersBackend(
        TransformersBackendConfig(model=str(default_model_dir), data_dir=backend.config.data_dir)
    )
    tb.load()
    try:
        tf = run(tb, "ivan", prompt, built.item_id, short)
    finally:
        asyncio.run(tb.aclose())
    assert (tf[2].cached_tokens, tf[0]) == (prompt.block_len, first[0])
    wait_idle(backend)
