"""The transformers backend: stop strings across token boundaries (no model), and on a tiny random llama,
concurrent requests taking turns on the one model thread with the same greedy tokens as alone."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from serving.backends.base import GenerationRequest, GenerationResult, QueueFull, SamplingParams, TokenDelta
from serving.backends.transformers_backend import TransformersBackend, TransformersBackendConfig, _StopMatcher
from tests.conftest import ForwardLog


def run(stops, deltas):
    m = _StopMatcher(stops)
    out, hit = [], False
    for d in deltas:
        ready, hit = m.feed(d)
        out.append(ready)
        if hit:
            break
    if not hit:
        out.append(m.flush())
    return "".join(out), hit, out


def test_stop_split_across_tokens_is_never_emitted():
    text, hit, pieces = run(["END"], ["Hello E", "N", "D and more"])
    assert (text, hit) == ("Hello ", True)
    assert pieces == ["Hello ", "", ""]


def test_held_back_prefix_is_released_when_it_does_not_become_a_stop():
    text, hit, pieces = run(["END"], ["Hello E", "N", "ough"])
    assert (text, hit) == ("Hello ENough", False)
    assert pieces == ["Hello ", "", "ENough", ""]


def test_earliest_of_several_stops_wins_and_no_stops_passes_through():
    assert run(["b", "a"], ["xxab"])[:2] == ("xx", True)
    assert run([], ["a", "b"])[:2] == ("ab", False)


# -- the backend on a tiny random llama: requests interleaved on the model thread -----------------------------


@pytest.fixture(scope="module")
def tiny_backend(tmp_path_factory, tiny_handle):
    model_dir = tmp_path_factory.mktemp("tiny-model")
    tiny_handle.model.save_pretrained(model_dir)
    tiny_handle.tokenizer.save_pretrained(model_dir)
    backend = TransformersBackend(
        TransformersBackendConfig(model=str(model_dir), data_dir=str(tmp_path_factory.mktemp("data")))
    )
    backend.load()
    yield backend
    asyncio.run(backend.aclose())


async def tokens_of(backend, req) -> tuple[list[int], GenerationResult]:
    ids, result = [], None
    async for item in backend.stream(req):
        if isinstance(item, TokenDelta):
            ids.extend(item.token_ids)
        else:
            result = item
    return ids, result


def test_concurrent_requests_interleave_on_the_model_thread_with_the_tokens_they_get_alone(tiny_backend):
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
    calls: list[tuple[int, threading.Thread]] = []  # (input length, thread) of every forward
    hook = backend.handle.model.register_forward_pre_hook(
        lambda _m, _a, kw: calls.append((kw["input_ids"].shape[1], threading.current_thread())),
        with_kwargs=True,
    )
    try:

        async def together():
            return await asyncio.gather(*(tokens_of(backend, r) for r in requests))

        both = asyncio.run(together())
    finally:
        hook.remove()
    assert [ids for ids, _ in both] == [ids for ids, _ in alone] and all(len(ids) == 8 for ids, _ in alone)
    assert [r.cached_tokens for _, r in both] == [block.num_tokens, 0, block.num_tokens]
    assert {thread for _, thread in calls} == {backend._loop.thread}
    prefills = [k for k, (n, _) in enumerate(calls) if n > 1]
    assert len(prefills) == 3 and prefills[-1] < len(calls) - 8  # the last prefill came before most decodes
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
    log = ForwardLog(backend.handle.model)
    try:

        async def together():
            return await asyncio.gather(*(tokens_of(backend, r) for r in requests))

        both = asyncio.run(together())
        wait_released(backend)
        mode_after = backend._loop.call(torch.is_inference_mode_enabled)
    finally:
        log.remove()
    assert [ids for ids, _ in both] == [ids for ids, _ in alone]
    assert [len(ids) for ids, _ in both] == [2, 11, 6]
    assert [r.cached_tokens for _, r in both] == [block.num_tokens, 0, block.num_tokens]
    assert len(log.calls) == 2 + 11 + 6
    assert [tuple(state) for _, *state in log.calls] == [(True, False, False)] * 19
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
    hook = backend.handle.model.register_forward_pre_hook(lambda *_: calls.append(1))

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

    async def two_at_once():
        first = backend.stream(req)
        await anext(first)  # admitted and running
        with pytest.raises(QueueFull):
            await anext(backend.stream(req))
        rest = [item async for item in first]
        return rest[-1]

    try:
        result = asyncio.run(two_at_once())
        wait_released(backend)
        assert isinstance(result, GenerationResult) and result.completion_tokens == 4
        assert len(asyncio.run(tokens_of(backend, req))[0]) == 4  # the slot is free again
    finally:
        backend.config = TransformersBackendConfig(**{**backend.config.__dict__, "max_queue": 16})
