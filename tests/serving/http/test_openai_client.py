"""The official openai client, unchanged (max_retries=0), against a live server on 127.0.0.1.

Fake backend: these tests check the HTTP contract (shapes, streaming, usage, error mapping), not a model.
"""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
import openai
import pytest
from openai import OpenAI

from serving.backends.fake import FakeBackend
from tests.serving.conftest import MODEL, live_server, make_stack, wait_for

MEMORIES = ["Alice's cat is called Tofu.", "Alice drinks green tea every morning."]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    stack = make_stack(tmp_path_factory.mktemp("live"), backend=FakeBackend(reply="Hi Alice!", queue_size=1))
    stack.store.add("alice", texts=MEMORIES)
    stack.store.add("bob", text="Bob's secret is 4321.")
    stack.scheduler.flush()  # alice's block: her memories, longest unchanged first
    with live_server(stack.app) as url:
        yield stack, url
    stack.scheduler.stop()


def client(url: str, key: str = "sk-alice-0000") -> OpenAI:
    return OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)


def test_list_models(server) -> None:
    _, url = server
    models = client(url).models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].object == "model"
    assert models.data[0].owned_by == "kvmem"


def test_chat(server) -> None:
    stack, url = server
    out = client(url).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "what is my cat called"}], user="alice"
    )
    block_len = stack.backend.layout_prompt(list(MEMORIES), [], []).block_len
    assert out.object == "chat.completion"
    assert out.choices[0].message.content == "Hi Alice!"
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens == len("Hi Alice!")
    assert out.usage.prompt_tokens == len(stack.backend.requests[-1].prompt.ids)
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    assert out.usage.prompt_tokens_details.cached_tokens == block_len > 0
    block = stack.scheduler.get("alice").block
    assert out.model_extra["memory"] == {"used": [{"id": i, "tier": "kv"} for i in block.memory_ids]}


def test_streamed_chat_with_usage(server) -> None:
    stack, url = server
    chunks = list(
        client(url).chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "tea?"}],
            user="alice",
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Hi Alice!"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    last = chunks[-1]
    assert last.choices == []
    block_len = stack.backend.layout_prompt(list(MEMORIES), [], []).block_len
    assert last.usage.prompt_tokens_details.cached_tokens == block_len
    assert last.usage.completion_tokens == len("Hi Alice!")
    assert all(c.usage is None for c in chunks[:-1])


def test_error_mapping(server) -> None:
    _, url = server
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.AuthenticationError) as e401:
        client(url, key="sk-wrong-key").chat.completions.create(model=MODEL, messages=messages, user="alice")
    assert e401.value.status_code == 401
    assert e401.value.code == "invalid_api_key"
    with pytest.raises(openai.PermissionDeniedError) as e403:
        client(url).chat.completions.create(model=MODEL, messages=messages, user="bob")
    assert e403.value.code == "user_not_allowed"
    with pytest.raises(openai.NotFoundError) as e404:
        client(url).chat.completions.create(model="gpt-4o", messages=messages, user="alice")
    assert e404.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e400:
        client(url).chat.completions.create(model=MODEL, messages=messages, user="alice", n=2)
    assert (e400.value.code, e400.value.param) == ("unsupported_value", "n")
    with pytest.raises(openai.BadRequestError) as e400:
        client(url).chat.completions.create(model=MODEL, messages=[], user="alice")
    assert e400.value.param == "messages"


def test_queue_full_is_rate_limit(server) -> None:
    stack, url = server
    backend: FakeBackend = stack.backend
    backend.hold.set()
    first: list[int] = []
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hold"}], "user": "alice"}
    headers = {"Authorization": "Bearer sk-alice-0000"}
    t = threading.Thread(
        target=lambda: first.append(
            httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=30).status_code
        )
    )
    t.start()
    try:
        wait_for(lambda: backend.num_in_flight == 1, "the first request to occupy the queue")
        with pytest.raises(openai.RateLimitError) as e429:
            client(url).chat.completions.create(model=MODEL, messages=body["messages"], user="alice")
        assert e429.value.status_code == 429
        assert e429.value.code == "queue_full"
    finally:
        backend.hold.clear()
        t.join(timeout=30)
    assert first == [200]


def test_not_ready_is_503(tmp_path: Path) -> None:
    stack = make_stack(tmp_path, backend=FakeBackend(ready=False, ready_on_load=False))
    with live_server(stack.app) as url:
        assert httpx.get(f"{url}/health").status_code == 503
        with pytest.raises(openai.InternalServerError) as e503:
            client(url).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
        assert e503.value.status_code == 503
        assert e503.value.code == "model_not_ready"
        stack.backend.set_ready(True)
        formation = {
            "extractor": "rules",
            "pending_turns": 0,
            "dead_turns": 0,
            "circuit": "closed",
            "circuit_until": None,
            "last_error": None,
        }
        assert httpx.get(f"{url}/health").json() == {
            "status": "ok",
            "model": MODEL,
            "backend": "fake",
            "formation": formation,
        }
    stack.scheduler.stop()
