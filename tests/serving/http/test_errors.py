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
