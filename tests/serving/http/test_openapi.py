"""/openapi.json documents what the server sends: 400 with OpenAI error JSON for invalid requests, never 422."""

from __future__ import annotations

from fastapi.testclient import TestClient

from tests.serving.conftest import ALICE, MODEL, Stack

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


def _request_schema(openapi: dict, path: str, method: str = "post") -> dict:
    """The JSON schema of an operation's request body, its $refs resolved against the whole document."""
    body = openapi["paths"][path][method]["requestBody"]["content"]["application/json"]["schema"]
    return {**openapi, **body}


def test_the_schema_refuses_what_the_server_refuses(client: TestClient, stack: Stack) -> None:
    """/openapi.json accepted an empty search query, `messages: []` and a PATCH of nulls, which the server
    refuses: the models carry the constraints, so the schema and the server agree on each body below."""
    from jsonschema import Draft202012Validator

    openapi = client.get("/openapi.json").json()
    (memory,) = stack.store.add("alice", "I keep bees")
    alice = {"user_id": "alice"}

    def invalid(message: str, param: str | None) -> dict:
        return {
            "error": {
                "message": message,
                "type": "invalid_request_error",
                "param": param,
                "code": "invalid_value",
            }
        }

    blank = "must not be empty or only whitespace"
    refused = [
        (
            "post",
            "/v1/memories/search",
            {**alice, "query": ""},
            invalid("invalid request: query: String should have at least 1 character", "query"),
        ),
        (
            "post",
            "/v1/memories/search",
            {**alice, "query": " \n"},
            invalid(f"invalid request: query: {blank}", "query"),
        ),
        (
            "post",
            "/v1/memories",
            {**alice, "messages": []},
            invalid(
                "invalid request: messages: List should have at least 1 item after validation, not 0",
                "messages",
            ),
        ),
        (
            "post",
            "/v1/memories",
            {**alice, "text": "x", "tags": ["home", " "]},
            invalid(f"invalid request: tags.1: {blank}", "tags.1"),
        ),
        (
            "patch",
            "/v1/memories/{memory_id}",
            {**alice, "text": None, "tags": None, "metadata": None},
            invalid("invalid request: give at least one of `text`, `tags` or `metadata`", None),
        ),
        (
            "patch",
            "/v1/memories/{memory_id}",
            alice,
            invalid("invalid request: give at least one of `text`, `tags` or `metadata`", None),
        ),
    ]
    for method, path, body, error in refused:
        assert not Draft202012Validator(_request_schema(openapi, path, method)).is_valid(body), (path, body)
        r = client.request(method, path.format(memory_id=memory.id), json=body, headers=ALICE)
        assert (r.status_code, r.json()) == (400, error), (path, body)
    both = {**alice, "text": "x", "messages": [{"role": "user", "content": "y"}]}  # exactly one of them
    assert not Draft202012Validator(_request_schema(openapi, "/v1/memories")).is_valid(both)
    assert client.post("/v1/memories", json=both, headers=ALICE).status_code == 400
    chat = {"model": MODEL, "messages": [{"role": "system", "content": "be brief"}]}  # no user message
    assert not Draft202012Validator(_request_schema(openapi, "/v1/chat/completions")).is_valid(chat)
    assert client.post("/v1/chat/completions", json=chat, headers=ALICE).status_code == 400

    accepted = [
        ("post", "/v1/memories/search", {**alice, "query": " bees", "top_k": 3.0}, 200),
        (
            "post",
            "/v1/memories",
            {**alice, "text": None, "messages": [{"role": "user", "content": "I like figs"}]},
            201,
        ),
        ("patch", "/v1/memories/{memory_id}", {**alice, "text": None, "tags": ["home"]}, 200),
    ]
    for method, path, body, status in accepted:
        assert Draft202012Validator(_request_schema(openapi, path, method)).is_valid(body), (path, body)
        r = client.request(method, path.format(memory_id=memory.id), json=body, headers=ALICE)
        assert r.status_code == status, (path, body, r.text)
