"""/openapi.json documents what the server sends: 400 with OpenAI error JSON for invalid requests, never 422."""

from __future__ import annotations

from fastapi.testclient import TestClient

from tests.serving.conftest import ALICE, Stack

METHODS = ("get", "put", "post", "delete", "patch")


def test_every_operation_documents_400_and_none_422(client: TestClient) -> None:
    schema = client.get("/openapi.json").json()
    operations = [
        (method.upper(), path, op["responses"])
        for path, item in schema["paths"].items()
        for method, op in item.items()
        if method in METHODS
    ]
    assert len(operations) >= 15
    assert [(m, p) for m, p, r in operations if "422" in r] == []
    assert [(m, p) for m, p, r in operations if "400" not in r] == []
    for _, _, responses in operations:
        assert responses["400"]["content"]["application/json"]["schema"] == {
            "$ref": "#/components/schemas/Error"
        }
    error = schema["components"]["schemas"]["Error"]["properties"]["error"]
    assert sorted(error["required"]) == ["code", "message", "param", "type"]
    assert "HTTPValidationError" not in schema["components"]["schemas"]


def test_what_is_documented_is_sent(client: TestClient, stack: Stack) -> None:
    r = client.post("/v1/memories", json={"user_id": "alice", "text": 5}, headers=ALICE)
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_metrics_is_documented_as_the_text_it_is(client: TestClient) -> None:
    """The schema documented /metrics as JSON (FastAPI's default) while it answers Prometheus text."""
    schema = client.get("/openapi.json").json()
    ok = schema["paths"]["/metrics"]["get"]["responses"]["200"]
    assert ok["content"] == {"text/plain": {"schema": {"type": "string"}}}
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"


def test_memory_id_paths_are_documented_without_their_convertor(client: TestClient) -> None:
    paths = client.get("/openapi.json").json()["paths"]
    assert sorted(paths["/v1/memories/{memory_id}"]) == ["delete", "get", "patch"]
    assert not [p for p in paths if ":" in p]
