"""Error answers of the app's own error mapping (serving/http/errors.py), exact: a body that is not JSON says
where, and a 405 says which methods the path takes."""

from __future__ import annotations

from fastapi.testclient import TestClient

from tests.serving.conftest import ALICE

JSON = {**ALICE, "content-type": "application/json"}


def invalid_json(message: str) -> dict:
    return {
        "error": {"message": message, "type": "invalid_request_error", "param": None, "code": "invalid_json"}
    }


def test_a_body_that_is_not_json_is_a_400_that_says_where(client: TestClient) -> None:
    """invalid_json gave no position."""
    cases = [
        (b'{"user_id": "alice" "text": "x"}', "Expecting ',' delimiter at line 1 column 21 (char 20)"),
        (b'{\n  "user_id": "alice",\n  "text": x\n}', "Expecting value at line 3 column 11 (char 34)"),
        (b"[1, 2", "Expecting ',' delimiter at line 1 column 6 (char 5)"),
        (b'{"text": "caf\xe9"}', "not UTF-8 (byte 0xe9 at position 13)"),
        (b"[" * 100_000, "arrays and objects nested too deeply to parse"),
    ]
    for body, where in cases:
        r = client.post("/v1/memories", content=body, headers=JSON)
        assert (r.status_code, r.json()) == (
            400,
            invalid_json(f"the request body is not valid JSON: {where}"),
        )


def test_a_405_says_which_methods_the_path_takes(client: TestClient) -> None:
    """405 answers lacked `Allow`. The fixed paths under /v1/memories are not memory ids: GET
    /v1/memories/search was a lookup of a memory named "search" (404), PATCH /v1/memories/plan an update."""
    not_allowed = {
        "error": {
            "message": "Method Not Allowed",
            "type": "invalid_request_error",
            "param": None,
            "code": "method_not_allowed",
        }
    }
    cases = [
        ("TRACE", "/v1/models", "GET"),
        ("POST", "/health", "GET"),
        ("PUT", "/v1/memories", "DELETE, GET, POST"),
        ("GET", "/v1/memories/search", "POST"),
        ("PATCH", "/v1/memories/plan", "GET"),
        ("DELETE", "/v1/memories/turns", "GET"),
        ("POST", "/v1/memories/formation", "GET"),
        ("GET", "/v1/memories/formation/retry", "POST"),
        ("POST", "/v1/memories/some-id", "DELETE, GET, PATCH"),
        ("OPTIONS", "/v1/chat/completions", "POST"),
    ]
    for method, path, allow in cases:
        r = client.request(method, path, params={"user_id": "alice"}, headers=ALICE)
        assert (r.status_code, r.headers.get("allow"), r.json()) == (405, allow, not_allowed), (method, path)
    r = client.get("/v1/memories/some-id", params={"user_id": "alice"}, headers=ALICE)
    assert r.status_code == 404 and r.json()["error"]["code"] == "memory_not_found"
