"""Batched decode in the transformers backend (tiny llama, prefill chunks of 16 tokens): a long prefill goes
in chunks, each packed into one forward with a running stream's decode step; a client that leaves, or a request whose step fails, leaves the
batch while the others keep exactly the tokens they get alone."""

from __future__ import annotations

import asyncio
import time

import pytest

from serving.backends.base import (
    BackendError,
    GenerationRequest,
    GenerationResult,
    SamplingParams,
    TokenDelta,
)
from serving.backends.transformers.backend import TransformersBackend, TransformersBackendConfig
from tests.conftest import EngineForwards
from tests.serving.backends.test_transformers_backend import run_together, tokens_of, wait_released

CHUNK = 16


@pytest.fixture(scope="module")
def chunked_backend(tmp_path_factory, tiny_model_dir):
    backend = TransformersBackend(
        TransformersBackendConfig(
            model=str(tiny_model_dir),
            data_dir=str(tmp_path_factory.mktemp("data")),
            prefill_chunk_tokens=CHUNK,
            build_chunk_tokens=CHUNK,
        )
    )
    backend.load()
    yield backend
    asyncio.run(backend.aclose())


def request(backend, name: str, question: str, max_new: int, block=None, texts=()) -> GenerationRequest:
    prompt = backend.layout_prompt(
        list(texts), [], [{"role": "user", "content": question}], block.token_ids if block else None
    )
    sampling = SamplingParams(max_new_tokens=max_new, temperature=0.0)
    return GenerationRequest(name, "u", prompt, block.item_id if block else None, sampling)


def record_shapes() -> tuple[list, object]:
    shapes: list = []  # (batch, input length) of every forward of the engine, and markers
    hook = EngineForwards(lambda ids: shapes.append(tuple(ids.shape)))
    return shapes, hook


def test_a_long_prefill_goes_in_chunks_between_a_running_streams_steps(chunked_backend):
    backend = chunked_backend
    running = request(backend, "running", "Hi", 30)
    long_question = "Tell me about " + ", ".join(f"item number {i}" for i in range(25)) + "."
    newcomer = request(backend, "newcomer", long_question, 3)
    # what it prefills: its prompt after the system prompt's head, shared by every request without a block
    n = len(newcomer.prompt.ids) - backend.head_item.num_tokens
    chunks = [CHUNK] * (n // CHUNK) + ([n % CHUNK] if n % CHUNK else [])
    assert len(chunks) >= 5
    alone = [asyncio.run(tokens_of(backend, r))[0] for r in (running, newcomer)]
    for r in (
        running,
        newcomer,
    ):  # run again as the first time: the prefix cache (its own tests) forgets them
        backend.pool.prefix.drop_user(r.user_id)
    shapes, hook = record_shapes()
    start = backend._loop.start

    def start_and_mark(steps):
        shapes.append("queued")
        start(steps)

    async def both():
        stream = backend.stream(running)
        ids = [(await anext(stream)).token_ids[0]]  # running is decoding
        backend._loop.start = start_and_mark
        task = asyncio.create_task(tokens_of(backend, newcomer))
        async for item in stream:
            if isinstance(item, TokenDelta):
                ids.extend(item.token_ids)
        return ids, (await task)[0]

    try:
        got = asyncio.run(both())
        wait_released(backend)
    finally:
        hook.remove()
        del backend._loop.start
    assert list(got) == alone
    after = shapes[shapes.index("queued") + 1 :]
    first = after.index((1, chunks[0] + 1))
    assert after[:first] in ([], [(1, 1)])  # the running stream's step in progress when the newcomer came
    # each chunk packed with the running stream's decode step; after the last chunk, both decode together:
    # one forward of their two rows, packed as one input (serving/engine/runner.py)
    expected = [(1, c + 1) for c in chunks] + [(1, 2), (1, 2)]
    assert after[first : first + len(expected)] == expected
    assert all(s == (1, 1) for s in after[first + len(expected) :])


def test_a_client_leaving_and_a_failing_request_leave_the_batch_to_the_others(chunked_backend):
    backend = chunked_backend
    texts = ["I live in Lisbon.", "My dog is called Miso."]
    block = backend.build_block("u", texts, ["m1", "m2"])
    stay_a = request(backend, "a", "Where do I live?", 9, block, texts)
    leaver = request(backend, "leaver", "Tell me a long story about my dog.", 40, block, texts)
    failing = request(backend, "failing", "What is the capital of Portugal, and of Spain?", 9)
    stay_b = request(backend, "b", "Hi", 6)
    alone = {r.request_id: asyncio.run(tokens_of(backend, r))[0] for r in (stay_a, leaver, stay_b)}
    # a token of its prompt in no other prompt nor output: any forward holding it fails (the packed one, then
    # its chunk alone), whatever prefix its prefill starts after
    others = {t for r in (stay_a, leaver, stay_b) for t in r.prompt.ids} | {
        t for v in alone.values() for t in v
    }
    marker = next(t for t in failing.prompt.ids if t not in others)

    def fail(ids):
        if marker in ids[0].tolist():
            raise RuntimeError("forward failed")

    async def leave_after_two():
        ids, stream = [], backend.stream(leaver)
        async for item in stream:
            ids.extend(item.token_ids)
            if len(ids) == 2:
                await stream.aclose()  # what the server does when the client disconnects
                return ids

    hook = EngineForwards(fail)
    try:
        a, left, failed, b = run_together(
            backend,
            [
                tokens_of(backend, stay_a),
                leave_after_two(),
                tokens_of(backend, failing),
                tokens_of(backend, stay_b),
            ],
        )
        wait_released(backend)
    finally:
        hook.remove()
    assert a[0] == alone["a"] and b[0] == alone["b"] and left == alone["leaver"][:2]
    assert isinstance(a[1], GenerationResult) and (a[1].completion_tokens, b[1].completion_tokens) == (9, 6)
    assert isinstance(failed, BackendError) and "forward failed" in str(failed)
    deadline = time.monotonic() + 5  # a request is released just before it returns and leaves the batcher
    while len(backend._loop._batcher) and time.monotonic() < deadline:
        time.sleep(0.001)
    assert len(backend._loop._batcher) == 0


def test_a_block_build_goes_in_chunks_between_a_running_streams_steps(chunked_backend):
    """A build is a prefill in the engine's steps: each chunk packed with the running stream's decode step
    (the stream never waits for the whole block); the stream keeps its tokens alone; the built item's K/V
    equal build_item's to within rounding, and a request over it answers as a full prefill does."""
    import threading

    import torch

    from kvmem.kv import Sampling, build_item, generate

    backend = chunked_backend
    texts = [f"Memory {i}: I keep {i} beehives on the hill behind the old mill." for i in range(8)]
    found = backend.builder.lookup("builder", texts, [f"b{i}" for i in range(len(texts))])
    n = len(found.ids)
    assert n > 5 * CHUNK
    running = request(backend, "running", "Hi", 40)
    alone = asyncio.run(tokens_of(backend, running))[0]
    backend.pool.prefix.drop_user(running.user_id)  # run again as the first time
    shapes, hook = record_shapes()
    built: list = []

    async def stream_while_building():
        stream = backend.stream(running)
        ids = [(await anext(stream)).token_ids[0]]  # running is decoding
        shapes.append("build")
        worker = threading.Thread(
            target=lambda: built.append(
                backend.build_block("builder", texts, [f"b{i}" for i in range(len(texts))])
            )
        )
        worker.start()
        async for item in stream:
            if isinstance(item, TokenDelta):
                ids.extend(item.token_ids)
        await asyncio.to_thread(worker.join, 30)
        return ids

    try:
        got = asyncio.run(stream_while_building())
        wait_released(backend)
    finally:
        hook.remove()
    assert got == alone and len(built) == 1 and built[0].num_tokens == n
    after = shapes[shapes.index("build") + 1 :]
    chunks = [CHUNK] * (n // CHUNK) + ([n % CHUNK] if n % CHUNK else [])
    first = after.index((1, chunks[0] + 1))
    assert after[first : first + len(chunks)] == [(1, c + 1) for c in chunks]  # each with a decode step
    item = backend.store.get(built[0].item_id)
    reference = build_item(backend.handle, found.ids, user_id="builder")
    assert item.token_ids == reference.token_ids
    assert torch.allclose(item.kv, reference.kv, atol=1e-5, rtol=1e-4)
    ids = backend.layout_prompt(
        texts, [], [{"role": "user", "content": "How many hives?"}], item.token_ids
    ).ids
    full = list(generate(backend.handle.model, ids, sampling=Sampling(max_new_tokens=8)))
    assert list(generate(backend.handle.model, ids, item=item, sampling=Sampling(max_new_tokens=8))) == full
    # every page came back but the resident items' and those the prefix cache keeps of the finished stream
    cached = backend.pool.prefix.pages(running.user_id)
    assert cached and backend.pool.used_pages == backend.pool.shared.page_count() + len(set(cached))


def test_a_build_with_no_stream_running_takes_full_prefill_chunks(tmp_path, tiny_model_dir):
    """Small build chunks are for steps shared with streams: a build that runs alone goes in
    prefill_chunk_tokens at a time (here 64 against a build chunk of 16), and its item is the same."""
    import torch

    from kvmem.kv import build_item

    backend = TransformersBackend(
        TransformersBackendConfig(
            model=str(tiny_model_dir), data_dir=str(tmp_path), prefill_chunk_tokens=64, build_chunk_tokens=16
        )
    )
    backend.load()
    try:
        texts = [f"Memory {i}: I keep {i} beehives on the hill behind the old mill." for i in range(8)]
        found = backend.builder.lookup("builder", texts, [f"b{i}" for i in range(len(texts))])
        n = len(found.ids)
        assert n > 3 * 64
        shapes, hook = record_shapes()
        try:
            built = backend.build_block("builder", texts, [f"b{i}" for i in range(len(texts))])
        finally:
            hook.remove()
        assert shapes == [(1, 64)] * (n // 64) + ([(1, n % 64)] if n % 64 else [])
        item = backend.store.get(built.item_id)
        reference = build_item(backend.handle, found.ids, user_id="builder")
        assert item.token_ids == reference.token_ids
        assert torch.allclose(item.kv, reference.kv, atol=1e-5, rtol=1e-4)
        assert backend.pool.used_pages == backend.pool.shared.page_count()
    finally:
        asyncio.run(backend.aclose())
