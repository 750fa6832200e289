"""Request-size limits through HTTP (fake backend): each refusal's exact status and error JSON, naming the
field and the limit; nothing reaches the backend or the store."""

from __future__ import annotations

from fastapi.testclient import TestClient

from serving.chat import MAX_STOP_CHARS
from tests.serving.conftest import ALICE, MODEL, Stack


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
