"""Slow clients: a live server closes a connection whose body (LimitBody, 408) or headers (the h11 protocol of
serving/http/server.py) do not arrive within `read_timeout_s`. Raw sockets against 127.0.0.1."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import uvicorn
from fastapi import FastAPI

from serving.http.server import uvicorn_config
from serving.ops.cli import UsageError, build_parser, config_from_args
from tests.serving.conftest import ALICE, make_stack

TIMEOUT_S = 0.5
BOUND_S = 5.0  # the test's patience: a closed connection must be seen well before this


@contextmanager
def serving(app: FastAPI, read_timeout_s: float) -> Iterator[int]:
    """`app` served as `kvmem serve` serves it (uvicorn_config) on 127.0.0.1; yields the port."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn_config(app, read_timeout_s, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    for _ in range(500):
        if server.started:
            break
        time.sleep(0.02)
    assert server.started
    try:
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def _read_until_closed(conn: socket.socket) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and how long that took (BOUND_S at most)."""
    conn.settimeout(BOUND_S)
    started, data = time.monotonic(), b""
    while True:
        try:
            chunk = conn.recv(65536)
        except TimeoutError:
            raise AssertionError(f"still open after {BOUND_S} s; got {data!r}") from None
        if not chunk:
            return data, time.monotonic() - started
        data += chunk


@pytest.fixture
def port(tmp_path: Path) -> Iterator[int]:
    stack = make_stack(tmp_path, read_timeout_s=TIMEOUT_S)
    with serving(stack.app, TIMEOUT_S) as p:
        yield p
    stack.scheduler.stop()


def test_stalled_bodies_are_answered_408_and_closed(port: int) -> None:
    head = (
        "POST /v1/memories HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer sk-alice-0000\r\n"
        "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n"
    )
    conns = [socket.create_connection(("127.0.0.1", port)) for _ in range(10)]
    for conn in conns:
        conn.sendall(head.encode() + b'{"user_id": "alice", "te')  # then nothing more
    for conn in conns:
        data, took_s = _read_until_closed(conn)
        conn.close()
        assert data.startswith(b"HTTP/1.1 408 "), data
        assert b'"code":"request_timeout"' in data and b"connection: close" in data.lower()
        assert took_s < BOUND_S


def test_stalled_headers_are_closed(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port)) as conn:
        conn.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0")  # then nothing more
        data, _ = _read_until_closed(conn)
    assert data.startswith(b"HTTP/1.1 408 ") and b"request_timeout" in data
    with socket.create_connection(("127.0.0.1", port)) as silent:  # connects, sends nothing
        data, _ = _read_until_closed(silent)
    assert data.startswith(b"HTTP/1.1 408 ")


def test_prompt_clients_are_unaffected(port: int) -> None:
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers=ALICE, timeout=10) as client:
        for _ in range(3):  # keep-alive: one connection, requests spread over more than the bound
            r = client.post("/v1/memories", json={"user_id": "alice", "text": "I like tea."})
            assert r.status_code == 201
            time.sleep(TIMEOUT_S / 2)
        assert client.get("/v1/memories", params={"user_id": "alice"}).json()["total"] == 3


def test_read_timeout_flag() -> None:
    assert config_from_args(build_parser().parse_args(["serve"])).read_timeout_s == 30.0
    args = build_parser().parse_args(["serve", "--read-timeout-s", "2.5"])
    assert config_from_args(args).read_timeout_s == 2.5
    with pytest.raises(UsageError, match="read_timeout_s must be > 0, got 0.0"):
        config_from_args(build_parser().parse_args(["serve", "--read-timeout-s", "0"]))
