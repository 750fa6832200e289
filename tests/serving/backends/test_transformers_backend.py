"""The transformers backend on a tiny random llama: concurrent requests taking turns on the one model thread
with the same greedy tokens as alone, every forward in inference mode, admission bounded and released."""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time

import pytest
import torch

from kvmem.errors import FingerprintMismatch, KVItemCorrupt, KVItemError
from serving.backends.base import (
    BackendError,
    BlockNotFound,
    GenerationRequest,
    GenerationResult,
    PoolFull,
    QueueFull,
    SamplingParams,
    TokenDelta,
)
from serving.backends.transformers.backend import TransformersBackend, TransformersBackendConfig
from serving.chat.service import MAX_STOP_CHARS
from tests.conftest import EngineForwards


async def tokens_of(backend, req) -> tuple[list[int], GenerationResult]:
    ids, result = [], None
    async for item in backend.stream(req):
        if isinstance(item, TokenDelta):
            ids.extend(item.token_ids)
        else:
            result = item
    return ids, result


def prefilled(backend, requests, results) -> list[int]:
    """The prompt tokens each request prefilled: those after its block, or, without one, after the system
    prompt's head the engine shares (TransformersBackend.head_item; not counted in cached_tokens)."""
    head = backend.head_item.num_tokens
    return [len(r.prompt.ids) - (c.cached_tokens or head) for r, c in zip(requests, results, strict=True)]


def run_together(backend, consumers) -> list:
    """Run the coroutines concurrently, all their requests reaching the model loop before its next turn (the
    loop is held in a call until they are queued), so the batch they form does not depend on timing. An
    exception a coroutine raises is its result."""
    release, entered = threading.Event(), threading.Event()

    def hold():
        entered.set()
        assert release.wait(10)

    holder = threading.Thread(target=backend._loop.call, args=(hold,))
    holder.start()
    assert entered.wait(10)

    async def together():
        tasks = [asyncio.create_task(c) for c in consumers]
        while len(backend._loop._incoming) < len(tasks):
            await asyncio.sleep(0.001)
        release.set()
        return await asyncio.gather(*tasks, return_exceptions=True)

    try:
        return asyncio.run(together())
    finally:
        release.set()
        holder.join(10)


def without_prefix_cache(backend, requests) -> None:
    """The prefix cache forgets the requests' users: what follows runs them again as the first time (the
    cache's reuse is tested in test_prefix_reuse.py)."""
    for user in {r.user_id for r in requests}:
        backend.pool.prefix.drop_user(user)


def arrive_together(backend, requests) -> list[tuple[list[int], GenerationResult]]:
    """Stream every request concurrently (run_together); every one must succeed."""
    results = run_together(backend, [tokens_of(backend, r) for r in requests])
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


def test_concurrent_requests_decode_as_one_batch_with_the_tokens_they_get_alone(tiny_backend):
    backend = tiny_backend
    block = backend.build_block("u", ["I live in Lisbon.", "My dog is called Miso."], ["m1", "m2"])
    questions = ["Where do I live?", "What is my dog called and what does he like to eat?", "Hi"]
    requests = []
    for i, question in enumerate(questions):
        with_block = i != 1
        prompt = backend.layout_prompt(
            ["I live in Lisbon.", "My dog is called Miso."] if with_block else [],
            [],
            [{"role": "user", "content": question}],
            block.token_ids if with_block else None,
        )
        requests.append(
            GenerationRequest(
                f"r{i}",
                "u",
                prompt,
                block.item_id if with_block else None,
                SamplingParams(max_new_tokens=8, temperature=0.0),
            )
        )
    alone = [asyncio.run(tokens_of(backend, r)) for r in requests]
    without_prefix_cache(backend, requests)
    calls: list[tuple[tuple[int, int], threading.Thread]] = []  # (input shape, thread) of every forward
    hook = EngineForwards(lambda ids: calls.append((tuple(ids.shape), threading.current_thread())))
    try:
        both = arrive_together(backend, requests)
    finally:
        hook.remove()
    assert [ids for ids, _ in both] == [ids for ids, _ in alone] and all(len(ids) == 8 for ids, _ in alone)
    assert [r.cached_tokens for _, r in both] == [block.num_tokens, 0, block.num_tokens]
    assert {thread for _, thread in calls} == {backend._loop.thread}
    # three prefills (what the block does not cover) packed in one forward, then 7 decode steps of all three
    # (each one forward of three rows, packed as one input: serving/engine/runner.py)
    rest = prefilled(backend, requests, [c for _, c in both])
    assert [shape for shape, _ in calls] == [(1, sum(rest))] + [(1, 3)] * 7
    deadline = (
        time.monotonic() + 5
    )  # each request's admission is released on the model thread, after its result
    while backend.queue_depth and time.monotonic() < deadline:
        time.sleep(0.001)
    assert backend.queue_depth == 0


def test_concurrent_requests_of_different_lengths_run_every_forward_in_inference_mode(tiny_backend):
    """The first request ends while the others still decode: no forward of theirs may leave inference mode
    (params require grad, so a forward outside it builds an autograd graph through the cache)."""
    backend = tiny_backend
    texts = ["I live in Lisbon.", "My dog is called Miso."]
    block = backend.build_block("u", texts, ["m1", "m2"])
    shapes = [  # (block?, question, max new tokens): the shortest is started first and ends first
        (True, "Hi", 2),
        (False, "Tell me everything you know about my dog and where I live, please.", 11),
        (True, "Where do I live?", 6),
    ]
    requests = []
    for i, (with_block, question, max_new) in enumerate(shapes):
        prompt = backend.layout_prompt(
            texts if with_block else [],
            [],
            [{"role": "user", "content": question}],
            block.token_ids if with_block else None,
        )
        sampling = SamplingParams(max_new_tokens=max_new, temperature=0.0)
        requests.append(
            GenerationRequest(f"r{i}", "u", prompt, block.item_id if with_block else None, sampling)
        )
    alone = [asyncio.run(tokens_of(backend, r)) for r in requests]
    without_prefix_cache(backend, requests)
    rows: list[int] = []  # batch size of every forward
    log = EngineForwards(lambda ids: rows.append(ids.shape[0]))  # what the server runs: its path
    try:
        both = arrive_together(backend, requests)
        wait_released(backend)
        mode_after = backend._loop.call(torch.is_inference_mode_enabled)
    finally:
        log.remove()
    assert [ids for ids, _ in both] == [ids for ids, _ in alone]
    assert [len(ids) for ids, _ in both] == [2, 11, 6]
    assert [r.cached_tokens for _, r in both] == [block.num_tokens, 0, block.num_tokens]
    # 3 prefills packed in one forward (a first token each), then decode steps: all 3 (the first ends), 2 x4
    # (the third ends), 1 x5; each step one forward of its rows packed as one input (serving/engine)
    rest = prefilled(backend, requests, [c for _, c in both])
    assert rows == [1] * 11
    assert [n for n, *_ in log.calls] == [sum(rest), 3, 2, 2, 2, 2, 1, 1, 1, 1, 1]
    assert [tuple(state) for _, *state in log.calls] == [(True, False, False)] * 11
    assert mode_after is False  # the model thread is left as it was found


def wait_released(backend) -> None:
    deadline = time.monotonic() + 5
    while backend.queue_depth and time.monotonic() < deadline:
        time.sleep(0.001)
    assert backend.queue_depth == 0


def test_a_client_leaving_mid_stream_frees_its_turn_and_the_queue(tiny_backend):
    backend = tiny_backend
    prompt = backend.layout_prompt([], [], [{"role": "user", "content": "Tell me a long story."}])
    long = GenerationRequest("long", "u", prompt, None, SamplingParams(max_new_tokens=500, temperature=0.0))
    calls: list[int] = []
    hook = EngineForwards(lambda ids: calls.append(1))

    async def leave_after_first_token():
        stream = backend.stream(long)
        first = await anext(stream)
        await stream.aclose()  # what the server does when the client disconnects
        return first

    try:
        first = asyncio.run(leave_after_first_token())
        wait_released(backend)
    finally:
        hook.remove()
    assert isinstance(first, TokenDelta) and len(calls) < 500  # generation stopped, not run to the end
    short = GenerationRequest("next", "u", prompt, None, SamplingParams(max_new_tokens=3, temperature=0.0))
    ids, result = asyncio.run(tokens_of(backend, short))
    assert len(ids) == 3 and result.completion_tokens == 3


def test_admission_is_bounded_and_released(tiny_backend):
    backend = tiny_backend
    backend.config = TransformersBackendConfig(**{**backend.config.__dict__, "max_queue": 1})
    prompt = backend.layout_prompt([], [], [{"role": "user", "content": "Hi"}])
    req = GenerationRequest("a", "u", prompt, None, SamplingParams(max_new_tokens=4, temperature=0.0))

    # the first request's decode forwards wait until the second was refused: it holds its slot meanwhile,
    # whatever the machine's load (without this the 4 tiny-model steps could end before the second arrives)
    refused, forwards = threading.Event(), []

    def hold(ids):
        forwards.append(1)
        if len(forwards) > 1:
            refused.wait(30)

    async def two_at_once():
        first = backend.stream(req)
        await anext(first)  # admitted and running
        try:
            with pytest.raises(QueueFull):
                await anext(backend.stream(req))
        finally:
            refused.set()
        rest = [item async for item in first]
        return rest[-1]

    hook = EngineForwards(hold)
    try:
        try:
            result = asyncio.run(two_at_once())
        finally:
            hook.remove()
        wait_released(backend)
        assert isinstance(result, GenerationResult) and result.completion_tokens == 4
        assert len(asyncio.run(tokens_of(backend, req))[0]) == 4  # the slot is free again
    finally:
        backend.config = TransformersBackendConfig(**{**backend.config.__dict__, "max_queue": 16})


def test_a_request_with_max_length_stop_strings_takes_one_step_per_turn_like_any_other(tiny_backend):
    """A hostile request (the most and longest stop strings allowed, many tokens) is running; a second
    request's prefill (packed with a hostile decode step) comes after the hostile step in progress when it
    arrives and at most one more."""
    backend = tiny_backend
    prompt = backend.layout_prompt([], [], [{"role": "user", "content": "Tell me a long story."}])
    n = MAX_STOP_CHARS
    stops = ("a" * (n - 1) + "b", " " * (n - 1) + "x", ("ab" * n)[:n], "e" * n)
    hostile = GenerationRequest(
        "hostile", "u", prompt, None, SamplingParams(max_new_tokens=300, temperature=0.0, stop=stops)
    )
    other_prompt = backend.layout_prompt(
        [], [], [{"role": "user", "content": "Hi there, how are you today?"}]
    )
    other = GenerationRequest(
        "other", "u", other_prompt, None, SamplingParams(max_new_tokens=2, temperature=0.0)
    )
    events: list[object] = []  # forward input lengths, and "queued" when the second request reaches the loop
    hook = EngineForwards(lambda ids: events.append(ids.shape[1]))
    start = backend._loop.start

    def start_and_mark(steps):
        events.append("queued")
        start(steps)

    async def run_both():
        stream = backend.stream(hostile)
        await anext(stream)  # the hostile request is decoding
        backend._loop.start = start_and_mark
        other_ids, _ = await tokens_of(backend, other)
        rest = [item async for item in stream]
        return other_ids, rest[-1]

    try:
        other_ids, result = asyncio.run(run_both())
        wait_released(backend)
    finally:
        hook.remove()
        del backend._loop.start
    assert len(other_ids) == 2 and result.completion_tokens == 300
    after = events[events.index("queued") + 1 :]
    other_prefill = after.index(len(other_prompt.ids) - backend.head_item.num_tokens + 1)
    assert after[:other_prefill] in ([], [1], [1, 1])  # hostile decode steps before the newcomer's prefill


@pytest.mark.parametrize(
    "error, kind",
    [
        (KVItemCorrupt("/data/kv/kv-9f3a.safetensors fails its checksum"), "corrupt"),
        (FingerprintMismatch("item kv-9f3a: tokenizer differs"), "fingerprint_mismatch"),
        (KVItemError("kv-9f3a: something else"), "other"),
    ],
)
def test_a_kv_fallback_reports_its_kind_and_logs_the_detail(tiny_backend, monkeypatch, caplog, error, kind):
    backend = tiny_backend
    texts = ["I live in Lisbon."]
    block = backend.build_block("u", texts, ["m1"])
    prompt = backend.layout_prompt(texts, [], [{"role": "user", "content": "Hi"}], block.token_ids)
    req = GenerationRequest(
        "r", "u", prompt, block.item_id, SamplingParams(max_new_tokens=2, temperature=0.0)
    )

    def fail(item_id):
        raise error

    monkeypatch.setattr(backend.store, "get", fail)
    without_prefix_cache(backend, [req])  # each case a first request (its prompt's pages cached by the last)
    _, result = asyncio.run(tokens_of(backend, req))
    assert (result.kv_fallback_reason, result.cached_tokens) == (kind, 0)
    assert str(error) in caplog.text  # the detail stays in the log line


def test_a_block_item_that_is_not_stored_is_refused_before_anything_is_generated(tiny_backend):
    """Issue 27 item 5c: the request's block item was dropped since it was prepared (a delete's cascade): the
    prompt holds the block's texts, maybe a deleted memory's, so the backend raises BlockNotFound before its
    first item (serving prepares the request again) instead of prefilling them; its admission is released."""
    backend = tiny_backend
    texts = ["I live in Porto."]
    block = backend.build_block("gone", texts, ["m-porto"])
    prompt = backend.layout_prompt(texts, [], [{"role": "user", "content": "Hi"}], block.token_ids)
    req = GenerationRequest(
        "r", "gone", prompt, block.item_id, SamplingParams(max_new_tokens=2, temperature=0.0)
    )
    assert backend.forget("gone", ["m-porto"]) == [block.item_id]
    with pytest.raises(BlockNotFound) as gone:
        asyncio.run(tokens_of(backend, req))
    assert gone.value.item_id == block.item_id
    assert backend.queue_depth == 0


def test_resolving_a_block_never_waits_on_the_store_lock_on_the_event_loop(tiny_backend):
    """Issue 27 item 4: another thread holds the KV store's lock (a device-to-host demotion, a delete's unlinks,
    a directory scan) while a request's block, on the device, is resolved: the event loop keeps running, and
    the request is served from the block once the lock is free. It was resolved on the loop before: the loop
    stood still until the lock was released."""
    backend = tiny_backend
    texts = ["I live in Faro."]
    block = backend.build_block("held", texts, ["m-faro"])
    assert backend.store.in_memory(block.item_id)
    prompt = backend.layout_prompt(texts, [], [{"role": "user", "content": "Hi"}], block.token_ids)
    req = GenerationRequest(
        "r", "held", prompt, block.item_id, SamplingParams(max_new_tokens=2, temperature=0.0)
    )
    locked, release = threading.Event(), threading.Event()

    def hold_the_lock() -> None:
        with backend.store._lock:
            locked.set()
            release.wait(3)

    async def scenario() -> tuple[float, GenerationResult]:
        holder = threading.Thread(target=hold_the_lock)
        holder.start()
        assert locked.wait(10)
        request = asyncio.create_task(tokens_of(backend, req))
        start = time.monotonic()
        await asyncio.sleep(0.05)  # the loop runs the request's first steps, then comes back here
        stalled_s = time.monotonic() - start
        release.set()
        _, result = await request
        holder.join(10)
        return stalled_s, result

    stalled_s, result = asyncio.run(scenario())
    assert stalled_s < 1.0  # 3 s when the resolution waited for the lock on the loop
    assert (result.kv_fallback_reason, result.cached_tokens) == (None, block.num_tokens)


def test_another_users_block_is_refused_as_wrong_user(tiny_backend):
    backend = tiny_backend
    texts = ["I live in Lisbon."]
    block = backend.build_block("u", texts, ["m1"])
    prompt = backend.layout_prompt(texts, [], [{"role": "user", "content": "Hi"}], block.token_ids)
    req = GenerationRequest(
        "r", "v", prompt, block.item_id, SamplingParams(max_new_tokens=2, temperature=0.0)
    )
    _, result = asyncio.run(tokens_of(backend, req))
    assert (result.kv_fallback_reason, result.cached_tokens) == ("wrong_user", 0)


def test_the_model_is_loaded_on_the_model_thread(tmp_path, tiny_model_dir, monkeypatch):
    """The model thread is the only one that runs OpenMP parallel work (a second team of threads made every
    small kernel of a step wait for a sleeping worker: see TransformersBackend._load)."""
    import threading

    import kvmem.models

    real, threads = kvmem.models.load_model, []

    def recording(*args, **kwargs):
        threads.append(threading.current_thread())
        return real(*args, **kwargs)

    monkeypatch.setattr(kvmem.models, "load_model", recording)
    backend = TransformersBackend(
        TransformersBackendConfig(model=str(tiny_model_dir), data_dir=str(tmp_path))
    )
    try:
        backend.load()
        backend.load()  # loaded once
        assert threads == [backend._loop.thread] and backend.is_ready()
    finally:
        asyncio.run(backend.aclose())


def test_a_model_the_engine_cannot_run_is_refused_at_load_with_the_reason(tmp_path, tokenizer):
    """Every request runs in the engine (serving/engine: one decode path), so a model whose layers are not
    attention it runs (here Mamba's, `linear_attention`) is refused when it loads, naming the model, its layer
    types and the backend that serves it; nothing is served."""
    from transformers import MambaConfig, MambaForCausalLM

    model_dir = tmp_path / "tiny-mamba"
    config = MambaConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, state_size=4)
    MambaForCausalLM(config).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    backend = TransformersBackend(
        TransformersBackendConfig(model=str(model_dir), data_dir=str(tmp_path / "data"), device="cpu")
    )
    try:
        with pytest.raises(
            BackendError, match=r"cannot serve .*tiny-mamba.*linear_attention.*--backend vllm"
        ):
            backend.load()
        assert not backend.is_ready()
    finally:
        asyncio.run(backend.aclose())


def test_the_pool_size_must_hold_pages():
    with pytest.raises(ValueError, match="kv_pool_mb >= 1"):
        TransformersBackendConfig(kv_pool_mb=0)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread niceness is Linux's")
def test_the_io_threads_run_below_the_model_threads_priority(tmp_path, tiny_model_dir):
    import os
    import threading

    from serving.backends.transformers.backend import IO_NICE

    backend = TransformersBackend(
        TransformersBackendConfig(model=str(tiny_model_dir), data_dir=str(tmp_path))
    )
    try:
        backend.load()
        backend.build_block("u", ["I keep bees."], ["m1"])  # the lookup and the write run on I/O threads
        io = [t for t in threading.enumerate() if t.name.startswith("kvmem-io")]
        base = os.getpriority(os.PRIO_PROCESS, backend._loop.thread.native_id)
        assert io and all(os.getpriority(os.PRIO_PROCESS, t.native_id) == base + IO_NICE for t in io)
    finally:
        asyncio.run(backend.aclose())


def test_a_request_without_a_block_starts_after_the_shared_system_prompt(tiny_backend, tmp_path):
    """The head every prompt starts with (system opening, system prompt, memory header) is K/V built once at
    load and read by reference: a request without a block prefills only what follows it, its greedy tokens
    are a full prefill's, cached_tokens counts it as no memory, and the stored block items are untouched.
    Not built without a pool (the per-request path), nor with shared knowledge installed."""
    from kvmem.kv import Sampling, generate

    backend = tiny_backend
    head = backend.head_item
    assert head is not None and head.token_ids == tuple(backend.layout.head_ids) and head.meta.user_id == ""
    questions = ["Who are you?", "Tell me something about the sea, please."]
    requests = [
        GenerationRequest(
            f"h{i}",
            "nobody",
            backend.layout_prompt([], [], [{"role": "user", "content": q}]),
            None,
            SamplingParams(max_new_tokens=6, temperature=0.0),
        )
        for i, q in enumerate(questions)
    ]
    model = backend.handle.model
    full = [
        backend._loop.call(
            lambda r=r: list(generate(model, r.prompt.ids, sampling=Sampling(max_new_tokens=6)))
        )
        for r in requests
    ]
    shapes: list[tuple[int, int]] = []
    hook = EngineForwards(lambda ids: shapes.append(tuple(ids.shape)))
    try:
        alone = [asyncio.run(tokens_of(backend, r)) for r in requests]
        without_prefix_cache(backend, requests)
        both = arrive_together(backend, requests)
    finally:
        hook.remove()
    assert [ids for ids, _ in alone] == [ids for ids, _ in both] == full
    assert [r.cached_tokens for _, r in alone + both] == [0, 0, 0, 0]
    rest = [len(r.prompt.ids) - head.num_tokens for r in requests]
    # alone: each prefill, then 5 decode steps; together: both prefills in one forward, then 5 steps of two
    assert (
        shapes
        == [(1, rest[0])] + [(1, 1)] * 5 + [(1, rest[1])] + [(1, 1)] * 5 + [(1, sum(rest))] + [(1, 2)] * 5
    )
    assert head.item_id in backend.pool.shared
    wait_released(backend)
    from kvmem.kv.knowledge import install

    install(tmp_path / "knowledge", ["Opening hours are 9 to 5."])
    other = TransformersBackend(
        TransformersBackendConfig(model=backend.config.model, data_dir=str(tmp_path / "knowledge"))
    )
    other.load()
    try:
        assert other.head_item is None and other.layout.knowledge_text
    finally:
        asyncio.run(other.aclose())


def test_with_knowledge_a_request_without_a_block_starts_from_the_stored_knowledge(tiny_model_dir, tmp_path):
    """With shared knowledge installed, a request without a block starts from the stored knowledge item (once a
    block built it, on the device), by reference as the blocks that have it as their parent do: it prefills
    only what follows it, its greedy tokens are a full prefill's, and cached_tokens counts the knowledge, as
    under a block.
    Before the item is stored, and after the knowledge changes, such a request prefills in full."""
    from kvmem.kv import Sampling, generate
    from kvmem.kv.knowledge import install, knowledge_item_id

    install(tmp_path, ["Opening hours are 9 to 5.", "The shop is closed on Sundays."])
    backend = TransformersBackend(
        TransformersBackendConfig(model=str(tiny_model_dir), data_dir=str(tmp_path))
    )
    backend.load()
    model = backend.handle.model

    def ask(question: str, i: int) -> GenerationRequest:
        prompt = backend.layout_prompt([], [], [{"role": "user", "content": question}])
        return GenerationRequest(
            # a user each: the prefix cache would serve one's repeat (test_prefix_reuse.py)
            f"k{i}",
            f"nobody-{i}",
            prompt,
            None,
            SamplingParams(max_new_tokens=6, temperature=0),
        )

    def served(req: GenerationRequest) -> tuple[list[int], int, list[int]]:
        """(its tokens, its cached_tokens, the lengths of the forwards it ran)"""
        shapes: list[int] = []
        hook = EngineForwards(lambda ids: shapes.append(ids.shape[1]))
        try:
            ids, result = asyncio.run(tokens_of(backend, req))
        finally:
            hook.remove()
        full = backend._loop.call(
            lambda: list(generate(model, req.prompt.ids, sampling=Sampling(max_new_tokens=6)))
        )
        assert ids == full
        return ids, result.cached_tokens, shapes

    try:
        assert backend.head_item is None and backend.layout.knowledge_text
        req = ask("When are you open?", 0)
        _, cached, shapes = served(req)  # the knowledge is not stored yet: no block was built
        assert cached == 0 and shapes[0] == len(req.prompt.ids)
        backend.build_block("u", ["I live in Lisbon."], ["m1"])  # builds the knowledge item, its parent
        knowledge = backend.store.get(knowledge_item_id(backend.layout, backend.handle.fingerprint))
        req = ask("When are you open, and on which days?", 1)
        assert tuple(req.prompt.ids[: knowledge.num_tokens]) == knowledge.token_ids
        _, cached, shapes = served(req)
        assert cached == knowledge.num_tokens and shapes[0] == len(req.prompt.ids) - knowledge.num_tokens
        assert knowledge.item_id in backend.pool.shared
        install(tmp_path, ["Opening hours are 10 to 6."])
        assert backend.reload_knowledge()
        req = ask("When are you open?", 2)
        _, cached, shapes = served(req)  # the new knowledge is not stored yet; the old one is not its head
        assert cached == 0 and shapes[0] == len(req.prompt.ids)
        wait_released(backend)
    finally:
        asyncio.run(backend.aclose())


def test_a_failing_release_still_ends_the_request_and_frees_its_admission(tiny_backend, monkeypatch, caplog):
    """Issue 42 item 1: a failure in a request's bookkeeping (here its sequence's release raises) is logged;
    the request still gets its final result and its admission slot is released, so no client hangs and the
    429s of leaked slots never come."""
    from serving.engine.sequence import EngineSequence

    backend = tiny_backend
    prompt = backend.layout_prompt([], [], [{"role": "user", "content": "Hi"}])
    req = GenerationRequest("r", "u", prompt, None, SamplingParams(max_new_tokens=3, temperature=0.0))
    real = EngineSequence.release

    def broken(seq):
        real(seq)
        raise AssertionError("bookkeeping bug")

    monkeypatch.setattr(EngineSequence, "release", broken)
    with caplog.at_level(logging.ERROR, logger="serving.backends.transformers.backend"):
        ids, result = asyncio.run(tokens_of(backend, req))
    wait_released(backend)
    assert len(ids) == 3 and result.completion_tokens == 3
    assert any("releasing what it held failed" in r.getMessage() for r in caplog.records)


def test_a_client_leaving_while_its_request_waits_for_pages_frees_its_slot_at_once(tiny_backend, monkeypatch):
    """Issue 42 item 5: a request waiting for KV pages whose client disconnects leaves the wait at once and
    frees its admission slot (the wait ignored the cancel: the slot stayed taken for `kv_wait_s`)."""
    from serving.engine.table import PageTable

    backend = tiny_backend
    config = backend.config
    backend.config = TransformersBackendConfig(**{**config.__dict__, "kv_wait_s": 600.0})
    prompt = backend.layout_prompt([], [], [{"role": "user", "content": "Hi"}])
    req = GenerationRequest("waits", "u", prompt, None, SamplingParams(max_new_tokens=4, temperature=0.0))
    tried, real = threading.Event(), PageTable.admit

    def admit(*args, **kwargs):
        tried.set()
        return real(*args, **kwargs)

    monkeypatch.setattr(PageTable, "admit", staticmethod(admit))
    pool = backend.pool

    def take_every_page() -> list[int]:  # unread blocks and sessions' caches evicted for them too
        held = []
        while True:
            try:
                held += pool.alloc(1)
            except PoolFull:
                return held

    held = backend._loop.call(take_every_page)  # the request waits

    async def leave_while_waiting():
        gone = asyncio.Event()

        async def disconnected() -> bool:
            return gone.is_set()

        stream = backend.stream(req, is_disconnected=disconnected)
        first = asyncio.ensure_future(anext(stream))
        assert await asyncio.to_thread(tried.wait, 30)  # it tried and waits for pages
        gone.set()
        with pytest.raises(StopAsyncIteration):
            await first

    try:
        asyncio.run(leave_while_waiting())
        wait_released(backend)
    finally:
        backend._loop.call(lambda: pool.release(held))
        backend.config = config
    ids, result = asyncio.run(tokens_of(backend, req))
    assert len(ids) == 4 and result.completion_tokens == 4


def test_the_pool_is_1_gib_on_cpu_and_a_fraction_of_free_memory_on_a_gpu(tiny_backend, monkeypatch):
    """Issue 42 item 4: with no kv_pool_mb the pool is 1 GiB on CPU, as before; on a GPU it is
    kv_pool_fraction of the device memory free after the model loaded (the free memory given here: this
    machine may have no GPU); the KV store keeps no device tier to reserve room for (issue 44 item 1)."""
    from types import SimpleNamespace

    backend = tiny_backend
    assert backend.config.kv_pool_mb is None
    assert backend.pool.num_pages == (1024 << 20) // backend.pool.shape.page_bytes
    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (40 * gib, 80 * gib))
    gpu = SimpleNamespace(device="cuda:0")
    assert backend._pool_bytes(gpu) == int(40 * gib * 0.8)
    config = backend.config
    try:
        backend.config = TransformersBackendConfig(**{**config.__dict__, "kv_pool_fraction": 0.5})
        assert backend._pool_bytes(gpu) == int(40 * gib * 0.5)
        backend.config = TransformersBackendConfig(**{**config.__dict__, "kv_pool_mb": 64})
        assert backend._pool_bytes(gpu) == 64 << 20  # a size given is taken as it is
    finally:
        backend.config = config
    with pytest.raises(ValueError, match=r"kv_pool_fraction must be in \(0, 1\], got 0"):
        TransformersBackendConfig(kv_pool_fraction=0)


def test_requests_the_pool_cannot_hold_at_once_are_preempted_and_stream_their_tokens_alone(
    tmp_path, tiny_model_dir, monkeypatch
):
    """Issue 42 item 3, through the backend: three replies that do not fit the pool together (1 MiB: 2,048
    tokens of the tiny llama) all stream to the end, one or more preempted and prefilled again on the way,
    each with the greedy tokens it has alone; every admission and page is given back."""
    from serving.engine.sequence import EngineSequence
    from tests.serving.kvstack import load_backend

    backend = load_backend(tiny_model_dir, tmp_path, kv_pool_mb=1)
    preempted: list[str] = []
    real = EngineSequence.preempt

    def counted(seq):
        preempted.append(seq)
        real(seq)

    monkeypatch.setattr(EngineSequence, "preempt", counted)
    try:
        questions = ["Hi", "Tell me about your day, in detail.", "What is the capital of Portugal and why?"]
        requests = [
            GenerationRequest(
                f"r{i}",
                "u",
                backend.layout_prompt([], [], [{"role": "user", "content": q}]),
                None,
                SamplingParams(max_new_tokens=750, temperature=0.0),
            )
            for i, q in enumerate(questions)
        ]
        pool = backend.pool
        assert all(pool.pages_for(len(r.prompt.ids) + 750) < pool.num_pages for r in requests)
        assert sum(pool.pages_for(len(r.prompt.ids) + 750) for r in requests) > pool.num_pages
        alone = [asyncio.run(tokens_of(backend, r)) for r in requests]
        without_prefix_cache(backend, requests)
        assert not preempted
        together = arrive_together(backend, requests)
        assert [ids for ids, _ in together] == [ids for ids, _ in alone]
        assert [len(ids) for ids, _ in alone] == [750] * 3  # no early stop: the pool ran dry
        assert preempted
        wait_released(backend)
        without_prefix_cache(
            backend, requests
        )  # the finished replies' cached pages go too: nothing else stays
        assert backend._loop.call(
            lambda: (pool.used_pages, pool.shared.page_count(), len(pool.preempted))
        ) == (
            pool.pages_for(backend.head_item.num_tokens),
            pool.pages_for(backend.head_item.num_tokens),
            0,
        )
    finally:
        asyncio.run(backend.aclose())


def test_a_request_that_waits_past_kv_wait_s_gets_pool_full_and_releases_cleanly(tiny_backend, caplog):
    """A request that waited for pages (parked) and found none by `kv_wait_s` gets PoolFull (429), frees its
    slot, and its end logs no failed release (its last wait is not a sequence to release)."""
    backend = tiny_backend
    config = backend.config
    backend.config = TransformersBackendConfig(**{**config.__dict__, "kv_wait_s": 0.2})
    prompt = backend.layout_prompt([], [], [{"role": "user", "content": "Hi"}])
    req = GenerationRequest("late", "u", prompt, None, SamplingParams(max_new_tokens=4, temperature=0.0))
    pool = backend.pool

    def take_every_page() -> list[int]:
        held = []
        while True:
            try:
                held += pool.alloc(1)
            except PoolFull:
                return held

    held = backend._loop.call(take_every_page)
    try:
        with caplog.at_level(logging.ERROR), pytest.raises(PoolFull, match="free pages"):
            asyncio.run(tokens_of(backend, req))
        wait_released(backend)
    finally:
        backend._loop.call(lambda: pool.release(held))
        backend.config = config
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
