"""The documented 16 KiB bound on a request's line and headers, under `kvmem serve`'s uvicorn settings
(serving/http/server.py): past it, 431 with OpenAI error JSON and the connection closed, whether the headers
arrive at once or a piece at a time. Raw sockets against 127.0.0.1."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from serving.http.server import MAX_HEADER_BYTES
from tests.serving.conftest import make_stack
from tests.serving.http.test_read_timeout import _read_until_closed, serving

TOO_LARGE = {
    "error": {
        "message": f"the request line and headers are over the limit of {MAX_HEADER_BYTES} bytes",
        "type": "invalid_request_error",
        "param": None,
        "code": "request_header_fields_too_large",
    }
}


@pytest.fixture
def port(tmp_path: Path) -> Iterator[int]:
    stack = make_stack(tmp_path)
    with serving(stack.app, 30.0) as p:
        yield p
    stack.scheduler.stop()


def _head(num_bytes: int) -> bytes:
    """GET /v1/models whose request line and headers are exactly `num_bytes` long (an X-Pad header fills it)."""
    start = b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer sk-alice-0000\r\nX-Pad: "
    end = b"\r\nConnection: close\r\n\r\n"
    head = start + b"p" * (num_bytes - len(start) - len(end)) + end
    assert len(head) == num_bytes
    return head


def _answer(data: bytes) -> tuple[bytes, dict[str, str], bytes]:
    head, _, body = data.partition(b"\r\n\r\n")
    status, *lines = head.split(b"\r\n")
    headers = {k.decode().lower(): v.decode().strip() for k, _, v in (line.partition(b":") for line in lines)}
    return status, headers, body


def test_headers_over_16_kib_sent_at_once_are_a_431(port: int) -> None:
    """65 kB of headers in one packet were parsed whole (h11's limit bounds only an incomplete head): 200."""
    for num_bytes in (MAX_HEADER_BYTES + 1, 65_000):
        with socket.create_connection(("127.0.0.1", port)) as conn:
            conn.sendall(_head(num_bytes))
            status, headers, body = _answer(_read_until_closed(conn)[0])
        assert status == b"HTTP/1.1 431 Request Header Fields Too Large"
        assert headers["content-type"] == "application/json" and headers["connection"] == "close"
        assert json.loads(body) == TOO_LARGE


def test_headers_over_16_kib_sent_a_piece_at_a_time_are_a_431(port: int) -> None:
    """uvicorn answered this 400 with a plain-text body; it is the same 431 as above."""
    with socket.create_connection(("127.0.0.1", port)) as conn:
        head = _head(20_000)
        for i in range(0, len(head), 1024):
            try:
                conn.sendall(head[i : i + 1024])
            except (BrokenPipeError, ConnectionResetError):  # refused before the rest was sent
                break
            time.sleep(0.005)
        status, headers, body = _answer(_read_until_closed(conn)[0])
    assert status == b"HTTP/1.1 431 Request Header Fields Too Large"
    assert json.loads(body) == TOO_LARGE


def test_headers_at_16_kib_are_served(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port)) as conn:
        conn.sendall(_head(MAX_HEADER_BYTES))
        status, _, body = _answer(_read_until_closed(conn)[0])
    assert status == b"HTTP/1.1 200 OK" and json.loads(body)["object"] == "list"
