"""OpenAI chat parameters through HTTP (fake backend: exact JSON) and through the transformers backend on the
tiny llama (exact tokens and logprobs): what is served, and each refusal's exact error."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from tests.serving.conftest import ALICE, MODEL, Stack


def body(content: str = "hello", **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded"])
def test_a_body_not_sent_as_json_is_refused_saying_so(stack: Stack, client: TestClient, content_type) -> None:
    headers = dict(ALICE) | ({"Content-Type": content_type} if content_type else {})
    r = client.post("/v1/chat/completions", content=json.dumps(body()), headers=headers)
    assert (r.status_code, r.json()) == (
        415,
        {
            "error": {
                "message": "the request body must be JSON sent with Content-Type: application/json",
                "type": "invalid_request_error",
                "param": None,
                "code": "unsupported_media_type",
            }
        },
    )
    assert stack.backend.requests == []
    headers["Content-Type"] = "application/json; charset=utf-8"
    assert client.post("/v1/chat/completions", content=json.dumps(body()), headers=headers).status_code == 200
