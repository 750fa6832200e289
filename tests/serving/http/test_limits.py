"""Request-size limits through HTTP (fake backend): each refusal's exact status and error JSON, naming the
field and the limit; nothing reaches the backend or the store."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from kvmem.text.store import dumps_jsonl
from serving.backends.fake import FakeBackend
from serving.chat.service import MAX_STOP_CHARS
from serving.config import Limits, ServingConfig
from serving.http.app import create_app
from tests.serving.conftest import ALICE, MODEL, Stack, make_stack


def chat_body(**extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], **extra}


def test_a_stop_string_over_its_length_limit_is_a_400_naming_stop(stack: Stack, client: TestClient) -> None:
    ok = ["x" * MAX_STOP_CHARS, "y"]
    r = client.post("/v1/chat/completions", json=chat_body(stop=ok), headers=ALICE)
    assert r.status_code == 200 and stack.backend.requests[-1].sampling.stop == tuple(ok)
    r = client.post(
        "/v1/chat/completions", json=chat_body(stop=["y", "x" * (MAX_STOP_CHARS + 1)]), headers=ALICE
    )
    assert (r.status_code, r.json()) == (
        400,
        {
            "error": {
                "message": "stop[1] has 65 characters, over the limit of 64 per stop string",
                "type": "invalid_request_error",
                "param": "stop",
                "code": "string_above_max_length",
            }
        },
    )
    r = client.post("/v1/chat/completions", json=chat_body(stop="z" * 1000), headers=ALICE)
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("stop[0] has 1000 characters")
    assert len(stack.backend.requests) == 1


SMALL = Limits(
    max_body_bytes=2000,
    max_messages=3,
    max_message_chars=50,
    max_memories_per_add=2,
    max_memory_text_chars=40,
    max_query_chars=30,
    max_tags=2,
    max_tag_chars=8,
    max_metadata_bytes=60,
)


@pytest.fixture
def small(tmp_path: Path) -> Iterator[tuple[Stack, TestClient]]:
    s = make_stack(tmp_path, limits=SMALL)
    with TestClient(s.app) as c:
        yield s, c
    s.scheduler.stop()


def error(status: int, message: str, param: str | None, code: str) -> tuple[int, dict]:
    return status, {
        "error": {"message": message, "type": "invalid_request_error", "param": param, "code": code}
    }


def test_limits_are_validated_and_the_app_builds_its_store_with_them(tmp_path: Path) -> None:
    assert Limits() == Limits(
        max_body_bytes=1 << 20,
        max_messages=256,
        max_message_chars=100_000,
        max_memories_per_add=100,
        max_memory_text_chars=100_000,
        max_query_chars=4_096,
        max_tags=32,
        max_tag_chars=128,
        max_metadata_bytes=8_192,
    )
    with pytest.raises(ValueError, match=r"^Limits.max_body_bytes must be a positive int, got 0$"):
        Limits(max_body_bytes=0)
    with pytest.raises(ValueError, match=r"^Limits.max_tags must be a positive int, got True$"):
        Limits(max_tags=True)
    config = ServingConfig(data_dir=tmp_path, backend="fake", auth=False, limits=SMALL)
    app = create_app(config, backend=FakeBackend())
    try:
        assert app.state.store.config.max_text_chars == 50  # the longer of a memory text and a chat message
    finally:
        app.state.scheduler.stop()
        app.state.store.close()


def test_a_body_over_the_limit_by_content_length_is_a_413_before_parsing(small) -> None:
    stack, client = small
    body = json.dumps(chat_body(messages=[{"role": "user", "content": "x" * 10}] * 3)).encode()
    padded = body[:-1] + b" " * (2000 - len(body)) + b"}"  # exactly at the limit: served
    r = client.post(
        "/v1/chat/completions", content=padded, headers={**ALICE, "content-type": "application/json"}
    )
    assert len(padded) == 2000 and r.status_code == 200
    r = client.post(
        "/v1/chat/completions", content=padded + b" ", headers={**ALICE, "content-type": "application/json"}
    )
    assert (r.status_code, r.json()) == error(
        413,
        "the request body has 2001 bytes, over the limit of 2000 (max_body_bytes)",
        None,
        "request_too_large",
    )
    assert len(stack.backend.requests) == 1
    r = client.post("/v1/memories", content=b"{" + b" " * 5000, headers=ALICE)  # never parsed: not a 400
    assert r.status_code == 413
    assert (
        'kvmem_requests_total{method="POST",route="unmatched",status="413"} 2' in client.get("/metrics").text
    )


def asgi_post(app, chunks: list[bytes], headers: list[tuple[bytes, bytes]]) -> tuple[int, dict, int]:
    """POST /v1/memories straight into the ASGI app, the body streamed in `chunks`: (status, JSON body,
    chunks the app read)."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/memories",
        "raw_path": b"/v1/memories",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), *headers],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }
    read, sent = 0, []

    async def receive():
        nonlocal read
        read += 1
        return {"type": "http.request", "body": chunks[read - 1], "more_body": read < len(chunks)}

    async def send(message):
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return sent[0]["status"], json.loads(body), read


def test_a_streamed_body_is_counted_and_refused_once_past_the_limit(small) -> None:
    stack, _ = small
    over = error(
        413, "the request body is over the limit of 2000 bytes (max_body_bytes)", None, "request_too_large"
    )
    chunked = [b"x" * 300] * 100  # no Content-Length: 30 kB in 300-byte chunks
    assert asgi_post(stack.app, chunked, []) == (*over, 7)  # 7 x 300 = 2100 > 2000: read no further
    lying = [b"y" * 1000] * 100
    assert asgi_post(stack.app, lying, [(b"content-length", b"10")]) == (*over, 3)
    assert stack.store.count("alice") == 0


def test_over_sized_chat_requests_are_400s_naming_the_limit(small) -> None:
    stack, client = small
    msg = {"role": "user", "content": "hi"}
    cases = [
        (
            chat_body(messages=[msg] * 4),
            error(
                400,
                "messages has 4 items, over the limit of 3 (max_messages)",
                "messages",
                "array_above_max_length",
            ),
        ),
        (
            chat_body(messages=[msg, {"role": "user", "content": "z" * 51}]),
            error(
                400,
                "messages[1].content has 51 characters, over the limit of 50 (max_message_chars)",
                "messages[1].content",
                "string_above_max_length",
            ),
        ),
        (
            chat_body(messages=[{"role": "user", "content": [{"type": "text", "text": "a" * 30}] * 2}]),
            error(
                400,
                "messages[0].content has 60 characters, over the limit of 50 (max_message_chars)",
                "messages[0].content",
                "string_above_max_length",
            ),
        ),
    ]
    for body, expected in cases:
        r = client.post("/v1/chat/completions", json=body, headers=ALICE)
        assert (r.status_code, r.json()) == expected
    r = client.post("/v1/chat/completions", json=chat_body(messages=[msg] * 3), headers=ALICE)
    assert r.status_code == 200 and len(stack.backend.requests) == 1


def test_over_sized_memory_requests_are_400s_and_leave_the_store_exactly_as_it_was(small) -> None:
    stack, client = small
    added = client.post(
        "/v1/memories", json={"user_id": "alice", "text": "I keep bees", "tags": ["home"]}, headers=ALICE
    )
    assert added.status_code == 201
    memory_id = added.json()["memories"][0]["id"]
    before = dumps_jsonl(stack.store)
    two = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    too_long = lambda param, n, limit, name: error(  # noqa: E731
        400,
        f"{param} has {n} characters, over the limit of {limit} ({name})",
        param,
        "string_above_max_length",
    )
    too_many = lambda param, n, limit, name: error(  # noqa: E731
        400, f"{param} has {n} items, over the limit of {limit} ({name})", param, "array_above_max_length"
    )
    big_metadata = error(
        400,
        "metadata is 61 bytes as JSON, over the limit of 60 (max_metadata_bytes)",
        "metadata",
        "object_above_max_size",
    )
    cases = [
        ("post", "/v1/memories", {"text": "t" * 41}, too_long("text", 41, 40, "max_memory_text_chars")),
        (
            "post",
            "/v1/memories",
            {"messages": two + two[:1]},
            too_many("messages", 3, 2, "max_memories_per_add"),
        ),
        (
            "post",
            "/v1/memories",
            {"messages": [two[0], {"role": "user", "content": "é" * 41}]},
            too_long("messages[1].content", 41, 40, "max_memory_text_chars"),
        ),
        ("post", "/v1/memories", {"text": "ok", "tags": ["a", "b", "c"]}, too_many("tags", 3, 2, "max_tags")),
        (
            "post",
            "/v1/memories",
            {"text": "ok", "tags": ["a", "b" * 9]},
            too_long("tags[1]", 9, 8, "max_tag_chars"),
        ),
        ("post", "/v1/memories", {"text": "ok", "metadata": {"k": "v" * 53}}, big_metadata),
        ("post", "/v1/memories/search", {"query": "q" * 31}, too_long("query", 31, 30, "max_query_chars")),
        (
            "post",
            "/v1/memories/search",
            {"query": "bees", "filters": {"tags": ["a", "b", "c"]}},
            too_many("filters.tags", 3, 2, "max_tags"),
        ),
        (
            "patch",
            f"/v1/memories/{memory_id}",
            {"text": "u" * 41},
            too_long("text", 41, 40, "max_memory_text_chars"),
        ),
        (
            "patch",
            f"/v1/memories/{memory_id}",
            {"tags": ["c" * 9]},
            too_long("tags[0]", 9, 8, "max_tag_chars"),
        ),
        ("patch", f"/v1/memories/{memory_id}", {"metadata": {"k": "v" * 53}}, big_metadata),
    ]
    for method, path, body, expected in cases:
        r = client.request(method, path, json={"user_id": "alice", **body}, headers=ALICE)
        assert (r.status_code, r.json()) == expected, (path, body)
    assert dumps_jsonl(stack.store) == before  # nothing stored was lost or changed, no version added
    at_limits = {"text": "t" * 40, "tags": ["a", "b" * 8], "metadata": {"k": "v" * 52}}
    assert (
        client.post("/v1/memories", json={"user_id": "alice", **at_limits}, headers=ALICE).status_code == 201
    )
    assert (
        client.patch(
            f"/v1/memories/{memory_id}", json={"user_id": "alice", **at_limits}, headers=ALICE
        ).status_code
        == 200
    )
    assert (
        client.post(
            "/v1/memories/search", json={"user_id": "alice", "query": "q" * 30}, headers=ALICE
        ).status_code
        == 200
    )


def test_metadata_nested_past_the_depth_limit_is_a_400_and_list_and_search_still_answer(
    stack: Stack, client: TestClient
) -> None:
    """300 levels were stored (201) and then broke the user's list and search (500), deeper was a 500 on add
    and edit: the depth is bounded like the other metadata limits, and nothing stored changes."""
    added = client.post(
        "/v1/memories",
        json={"user_id": "alice", "text": "I keep bees", "metadata": {"k": [1]}},
        headers=ALICE,
    )
    assert added.status_code == 201
    memory_id = added.json()["memories"][0]["id"]
    before = dumps_jsonl(stack.store)

    def nested(depth: int) -> dict:
        metadata: dict = {}
        for _ in range(depth - 1):
            metadata = {"a": metadata}
        return metadata

    for depth in (33, 300, 900):
        expected = error(
            400,
            f"metadata is nested {depth} levels deep, over the limit of 32 (max_metadata_depth)",
            "metadata",
            "object_above_max_depth",
        )
        body = json.dumps({"user_id": "alice", "text": "I keep wasps", "metadata": nested(depth)})
        json_headers = {**ALICE, "content-type": "application/json"}
        r = client.post("/v1/memories", content=body, headers=json_headers)
        assert (r.status_code, r.json()) == expected
        body = json.dumps({"user_id": "alice", "metadata": nested(depth)})
        r = client.patch(f"/v1/memories/{memory_id}", content=body, headers=json_headers)
        assert (r.status_code, r.json()) == expected
    assert dumps_jsonl(stack.store) == before
    listed = client.get("/v1/memories", params={"user_id": "alice"}, headers=ALICE)
    assert listed.status_code == 200 and [m["id"] for m in listed.json()["data"]] == [memory_id]
    found = client.post("/v1/memories/search", json={"user_id": "alice", "query": "bees"}, headers=ALICE)
    assert found.status_code == 200 and [m["id"] for m in found.json()["results"]] == [memory_id]
    r = client.patch(
        f"/v1/memories/{memory_id}", json={"user_id": "alice", "metadata": nested(32)}, headers=ALICE
    )
    assert r.status_code == 200 and r.json()["metadata"] == nested(32)  # at the limit: stored and read back
    listed = client.get("/v1/memories", params={"user_id": "alice"}, headers=ALICE)
    assert listed.status_code == 200 and listed.json()["data"][0]["metadata"] == nested(32)
