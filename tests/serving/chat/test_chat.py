"""The chat path through HTTP with the fake backend: exact shapes, prompt layout plumbing, sampling, errors.

The fake backend's prompts are character-exact, so what reached the "model" is asserted as text. None of this
says anything about a real model's output.
"""

from __future__ import annotations

import json
from pathlib import Path

from fastapi.testclient import TestClient

from scheduler import AccessEvent
from serving.backends.base import SamplingParams
from serving.backends.fake import SYSTEM_PROMPT, FakeBackend
from tests.serving.conftest import ALICE, MODEL, Stack, make_stack


def chat(client: TestClient, content: str = "hello", headers: dict | None = None, **extra) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}
    return client.post("/v1/chat/completions", json=body, headers=headers or ALICE)


def sse_events(text: str) -> list:
    assert text.endswith("data: [DONE]\n\n")
    lines = [line for line in text.split("\n\n") if line]
    assert all(line.startswith("data: ") for line in lines)
    return [json.loads(line[6:]) for line in lines[:-1]]


def test_completion_exact_shape(stack: Stack, client: TestClient) -> None:
    r = chat(client, "hello")
    assert r.status_code == 200
    body = r.json()
    req = stack.backend.requests[-1]
    prompt_tokens = len(req.prompt.ids)
    assert body == {
        "id": req.request_id,
        "object": "chat.completion",
        "created": body["created"],
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hello from kvmem."},
                "logprobs": None,
                "finish_reason": "stop",
            }
        ],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": 17,
            "total_tokens": prompt_tokens + 17,
            "prompt_tokens_details": {"cached_tokens": 0},
        },
        "system_fingerprint": None,
        "memory": {"used": []},
    }
    assert stack.backend.decode(req.prompt.ids) == f"<system>{SYSTEM_PROMPT}\n<user>hello\n<assistant>"
    assert req.sampling == SamplingParams(max_new_tokens=256)
    assert req.user_id == "alice" and req.block_item_id is None


def test_stream_exact_events(stack: Stack, client: TestClient) -> None:
    stack.backend.reply = "ab"
    r = chat(client, "hi", stream=True)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    rid = stack.backend.requests[-1].request_id
    common = {"id": rid, "object": "chat.completion.chunk", "model": MODEL, "system_fingerprint": None}
    assert [{k: e[k] for k in common} for e in events] == [common] * 4
    assert [e["choices"] for e in events] == [
        [
            {
                "index": 0,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
        ],
        [{"index": 0, "delta": {"content": "a"}, "logprobs": None, "finish_reason": None}],
        [{"index": 0, "delta": {"content": "b"}, "logprobs": None, "finish_reason": None}],
        [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}],
    ]
    assert all("usage" not in e for e in events)
    assert events[-1]["memory"] == {"used": []}


def test_sampling_params_reach_backend(stack: Stack, client: TestClient) -> None:
    r = chat(client, temperature=0.0, top_p=0.5, max_tokens=5, stop=["xyz"], seed=7)
    assert r.status_code == 200
    assert stack.backend.requests[-1].sampling == SamplingParams(
        max_new_tokens=5, temperature=0.0, top_p=0.5, stop=("xyz",), seed=7
    )
    assert r.json()["choices"][0]["message"]["content"] == "Hello"
    assert r.json()["choices"][0]["finish_reason"] == "length"
    r = chat(client, max_tokens=100, max_completion_tokens=3, stop="lo")
    assert stack.backend.requests[-1].sampling.max_new_tokens == 3
    assert r.json()["choices"][0]["message"]["content"] == "Hel"


def test_stop_string_is_cut(stack: Stack, client: TestClient) -> None:
    r = chat(client, stop=[" from"])
    assert r.json()["choices"][0]["message"]["content"] == "Hello"
    assert r.json()["choices"][0]["finish_reason"] == "stop"
    r = chat(client, stop=[" from"], stream=True)
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in sse_events(r.text) if e["choices"])
    assert text == "Hello"


def test_max_tokens_past_the_context_is_400_and_the_default_is_clamped(tmp_path: Path) -> None:
    """Issue 42 item 23: a max_tokens the context cannot hold after the prompt is refused with 400 naming the
    limit, as OpenAI does (10^9 was accepted and generated for minutes); the server's default reply length is
    clamped to the room left, and a max_tokens that fits is taken as it is."""
    s = make_stack(tmp_path, backend=FakeBackend(max_context_tokens=80))
    with TestClient(s.app) as client:
        r = chat(client, "hi", max_tokens=1)
        assert r.status_code == 200, r.text
        prompt_tokens = len(s.backend.requests[-1].prompt.ids)
        room = 80 - prompt_tokens
        served = len(s.backend.requests)
        for field, value in (("max_tokens", room + 1), ("max_completion_tokens", 10**9)):
            r = chat(client, "hi", **{field: value})
            error = r.json()["error"]
            assert r.status_code == 400 and (error["code"], error["param"]) == (
                "context_length_exceeded",
                field,
            )
            assert error["message"] == (
                f"{field} is {value} and the prompt has {prompt_tokens} tokens; the model's context length is "
                f"80 tokens, so at most {room} can be generated: lower {field}"
            )
        assert len(s.backend.requests) == served  # nothing reached the backend
        chat(client, "hi", max_tokens=room)
        assert s.backend.requests[-1].sampling.max_new_tokens == room
        chat(client, "hi")  # the default reply length (256) is clamped to what is left
        assert s.backend.requests[-1].sampling.max_new_tokens == room
        r = chat(client, "x" * 100)
        assert r.status_code == 400
        assert r.json()["error"]["code"] == "context_length_exceeded"
        assert r.json()["error"]["type"] == "invalid_request_error"
    s.scheduler.stop()


def test_bad_requests(client: TestClient) -> None:
    def err(body: object, raw: bool = False) -> tuple[int, str | None, str | None]:
        kw = {"content": body} if raw else {"json": body}
        r = client.post("/v1/chat/completions", headers={**ALICE, "content-type": "application/json"}, **kw)
        e = r.json()["error"]
        assert set(e) == {"message", "type", "param", "code"}
        return r.status_code, e["type"], e["param"]

    ok = [{"role": "user", "content": "x"}]
    assert err("{not json", raw=True) == (400, "invalid_request_error", None)
    assert err({"model": MODEL}) == (400, "invalid_request_error", "messages")
    assert err({"model": MODEL, "messages": []}) == (400, "invalid_request_error", "messages")
    assert err({"model": MODEL, "messages": ok, "temperature": "hot"}) == (
        400,
        "invalid_request_error",
        "temperature",
    )
    assert err({"model": MODEL, "messages": ok, "temperature": 3}) == (
        400,
        "invalid_request_error",
        "temperature",
    )
    assert err({"model": MODEL, "messages": ok, "max_tokens": 0}) == (
        400,
        "invalid_request_error",
        "max_tokens",
    )
    assert err({"model": MODEL, "messages": ok, "n": 3}) == (400, "invalid_request_error", "n")
    assert err({"model": MODEL, "messages": ok, "stop": ["a"] * 5}) == (400, "invalid_request_error", "stop")
    assert err({"model": MODEL, "messages": [{"role": "system", "content": "x"}]}) == (
        400,
        "invalid_request_error",
        "messages",
    )
    assert err({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}) == (
        400,
        "invalid_request_error",
        "messages.0.role",
    )
    assert err({"model": 5, "messages": ok}) == (400, "invalid_request_error", "model")
    assert err({"model": "nope", "messages": ok}) == (404, "invalid_request_error", "model")
    assert err([1, 2]) == (400, "invalid_request_error", None)


def test_n_one_is_fine_and_content_parts_are_joined(stack: Stack, client: TestClient) -> None:
    parts = [{"type": "text", "text": "hel"}, {"type": "text", "text": "lo"}]
    r = client.post(
        "/v1/chat/completions",
        json={
            "model": MODEL,
            "n": 1,
            "messages": [{"role": "developer", "content": "be brief"}, {"role": "user", "content": parts}],
        },
        headers=ALICE,
    )
    assert r.status_code == 200
    assert stack.backend.decode(stack.backend.requests[-1].prompt.ids).endswith(
        "<system>be brief\n<user>hello\n<assistant>"
    )


def test_memories_laid_out_block_then_text(stack: Stack, client: TestClient) -> None:
    old = stack.store.add("alice", text="alice plays the cello")[0]
    stack.scheduler.flush()
    new = stack.store.add("alice", text="alice plays chess on sundays")[0]
    r = chat(client, "what does alice play")
    prompt = stack.backend.decode(stack.backend.requests[-1].prompt.ids)
    assert prompt == (
        f"<system>{SYSTEM_PROMPT}\n[memory]\n- alice plays the cello\n"
        "[memory] alice plays chess on sundays\n<user>what does alice play\n<assistant>"
    )
    block_len = stack.backend.requests[-1].prompt.block_len
    assert block_len == len(f"<system>{SYSTEM_PROMPT}\n[memory]\n- alice plays the cello\n")
    body = r.json()
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == block_len
    assert body["memory"] == {"used": [{"id": old.id, "tier": "kv"}, {"id": new.id, "tier": "text"}]}
    assert stack.backend.block_ids_given == 1  # the plan's ids, checked against block_texts by the fake


def test_corrupt_block_falls_back_to_text(stack: Stack, client: TestClient) -> None:
    """Plumbing only: the backend reports a fallback; the answer succeeds and tiers say text."""
    m = stack.store.add("alice", text="alice likes jazz")[0]
    stack.scheduler.flush()
    stack.backend.corrupt(stack.scheduler.get("alice").block.item_id)
    r = chat(client, "music?")
    assert r.status_code == 200
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert r.json()["memory"] == {"used": [{"id": m.id, "tier": "text"}]}
    assert 'kvmem_kv_fallbacks_total{reason="corrupt"} 1' in client.get("/metrics").text


def test_turn_is_logged_after_the_reply(stack: Stack, client: TestClient) -> None:
    r = client.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "remember me"}]},
        headers={**ALICE, "X-Session-Id": "s1"},
    )
    assert r.status_code == 200
    client.portal.call(stack.app.state.chat.drain)
    # the turn goes to the conversation log, one row per message keeping its role; the user's message is
    # formed (in the background: it may be pending or formed by now, so it is read once formation is idle),
    # the reply is never formed; a request ("remember me") states no fact: no memory
    assert client.app.state.formation.wait_idle(20)
    log = stack.store.list_turns("alice", session_id="s1").items
    assert [(t.role, t.text, t.formation) for t in reversed(log)] == [
        ("user", "remember me", "formed"),
        ("assistant", "Hello from kvmem.", "skipped"),
    ]
    assert stack.store.list("alice").items == []
    # the scheduler's queue (no worker thread here): the new session's prewarm, the first plan read's
    # refresh, the turn's access event
    tasks = list(iter(lambda: stack.scheduler.queue.get(timeout_s=0), None))
    assert [(t.kind, t.user_id) for t in tasks] == [
        ("prewarm", "alice"),
        ("refresh", "alice"),
        ("access", "alice"),
    ]
    assert tasks[2].payload == AccessEvent("alice", (), (), 1_000_000.0, "s1")


def test_metrics_text(stack: Stack, client: TestClient) -> None:
    chat(client, "hi")
    chat(client, "hi", model="nope")
    text = client.get("/metrics").text
    assert 'kvmem_requests_total{method="POST",route="/v1/chat/completions",status="200"} 1' in text
    assert 'kvmem_requests_total{method="POST",route="/v1/chat/completions",status="404"} 1' in text
    assert 'kvmem_ttft_seconds_bucket{le="+Inf"} 1' in text
    assert "kvmem_ttft_seconds_count 1" in text
    assert 'kvmem_prefill_seconds_bucket{le="+Inf"} 1' in text and "kvmem_prefill_seconds_count 1" in text
    sums = dict(
        line.split(" ")
        for line in text.splitlines()
        if line.startswith(("kvmem_ttft_seconds_sum", "kvmem_prefill_seconds_sum"))
    )
    assert 0 < float(sums["kvmem_prefill_seconds_sum"]) <= float(sums["kvmem_ttft_seconds_sum"])
    assert "kvmem_queue_depth 0" in text
    assert "kvmem_cached_token_ratio 0.0" in text
    assert client.get("/metrics").headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"


def test_unknown_route_and_method(client: TestClient) -> None:
    r = client.get("/v2/nothing")
    assert (r.status_code, r.json()["error"]["code"]) == (404, "not_found")
    r = client.put("/v1/chat/completions")
    assert (r.status_code, r.json()["error"]["code"]) == (405, "method_not_allowed")


def test_a_huge_message_is_searched_by_its_last_max_query_chars_characters(tmp_path: Path) -> None:
    from serving.config import Limits

    stack = make_stack(tmp_path, limits=Limits(max_query_chars=40))
    searched: list[str] = []
    search = stack.store.search

    def spy(user_id: str, query: str, **kw):
        searched.append(query)
        return search(user_id, query, **kw)

    stack.store.search = spy  # type: ignore[method-assign]
    message = "lorem ipsum " * 100 + "where does my sister live in Lisbon?"
    with TestClient(stack.app) as client:
        assert chat(client, message).status_code == 200
        assert chat(client, "short question?").status_code == 200
    stack.scheduler.stop()
    assert searched == [message[-40:], "short question?"]
