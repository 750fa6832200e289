"""One user header: the router (deploy/haproxy.cfg) hashes on the header the chat route reads (X-Kvmem-User,
with X-User-Id its deprecated alias), in the server's order of precedence, so a user's chats and memory
writes land on one replica."""

from __future__ import annotations

import re
from pathlib import Path

from fastapi.testclient import TestClient

from serving.http.deps import DEPRECATED_USER_HEADER, USER_HEADER
from tests.serving.conftest import ALICE, MODEL, TEAM, Stack

HAPROXY_CFG = Path(__file__).resolve().parents[3] / "deploy" / "haproxy.cfg"
_SET_ROUTE = re.compile(r"^\s*http-request set-var\(txn\.route\) (\S+)", re.M)
ASK = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


def routing_sources() -> list[str]:
    """The router's routing-key sources, in the order HAProxy applies them (the last match wins)."""
    return _SET_ROUTE.findall(HAPROXY_CFG.read_text())


def test_the_router_hashes_the_headers_the_chat_route_reads_and_ranks_them_as_the_server_does(
    stack: Stack,
) -> None:
    chat = stack.app.openapi()["paths"]["/v1/chat/completions"]["post"]
    user_headers = {
        p["name"]: p.get("deprecated", False)
        for p in chat["parameters"]
        if p["in"] == "header" and "user" in p["name"].lower()
    }
    assert user_headers == {USER_HEADER: False, DEPRECATED_USER_HEADER: True}
    assert routing_sources() == [
        "req.hdr(Authorization)",
        f"req.hdr({DEPRECATED_USER_HEADER})",
        f"req.hdr({USER_HEADER})",  # wins over its alias
        "url_param(user_id)",  # a memory route's user, and a chat body's `user`, win over the header
        "req.body,json_query('$.user_id')",
        "req.body,json_query('$.user')",
    ]
    assert "balance hash var(txn.route)" in HAPROXY_CFG.read_text()


def test_the_chat_route_acts_for_the_user_the_router_hashed(stack: Stack, client: TestClient) -> None:
    r = client.post("/v1/chat/completions", json=ASK, headers={**TEAM, USER_HEADER: "bob"})
    assert r.status_code == 200, r.text
    r = client.post("/v1/chat/completions", json=ASK, headers={**TEAM, DEPRECATED_USER_HEADER: "alice"})
    assert r.status_code == 200, r.text
    r = client.post(
        "/v1/chat/completions", json={**ASK, "user": "alice"}, headers={**TEAM, USER_HEADER: "bob"}
    )
    assert r.status_code == 200, r.text  # the body's user wins, as the router's last match does
    assert [req.user_id for req in stack.backend.requests] == ["bob", "alice", "alice"]
    r = client.post("/v1/chat/completions", json=ASK, headers={**ALICE, USER_HEADER: "bob"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "user_not_allowed"
    both = {**TEAM, USER_HEADER: "alice", DEPRECATED_USER_HEADER: "bob"}
    r = client.post("/v1/chat/completions", json=ASK, headers=both)
    assert r.status_code == 400 and r.json()["error"] == {
        "message": "X-Kvmem-User names 'alice' but X-User-Id names 'bob': send one (X-User-Id is a deprecated "
        "alias of X-Kvmem-User)",
        "type": "invalid_request_error",
        "param": "X-Kvmem-User",
        "code": "conflicting_user_headers",
    }
    assert len(stack.backend.requests) == 3
