"""The uvicorn settings kvmem serves with: h11 with a bound on the time a client takes to send its headers and
on their size.

uvicorn closes idle keep-alive connections, but a connection that sends part of a request line or headers and
stalls is held forever; this protocol closes it (with a 408) `read_timeout_s` after it began sending. A request
line and headers over MAX_HEADER_BYTES are answered 431 and the connection closed: h11's own limit bounds only
an incomplete head (a larger one that arrives in one read was served), and uvicorn answered it 400 in plain
text. The body's own deadline is serving/http/limits.py's LimitBody. Knows nothing of routes or the app.
"""

from __future__ import annotations

import asyncio
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

MAX_HEADER_BYTES = 16 * 1024  # request line and headers together, as sent (CRLFs included)
_TIMEOUT_RESPONSE = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
    b"content-length: %d\r\n\r\n%s"
)
_TOO_LARGE_BODY = (
    b'{"error": {"message": "the request line and headers are over the limit of %d bytes", '
    b'"type": "invalid_request_error", "param": null, "code": "request_header_fields_too_large"}}'
    % MAX_HEADER_BYTES
)


def head_bytes(request: h11.Request) -> int:
    """The size of `request`'s line and headers on the wire, without the optional spaces h11 strips."""
    line = len(request.method) + len(request.target) + len(b"HTTP/") + len(request.http_version) + 4
    fields = sum(len(name) + len(value) + 4 for name, value in request.headers.raw_items())
    return line + fields + 2


class _HeadLimitedConnection(h11.Connection):
    """h11's server connection, refusing a request whose line and headers are over MAX_HEADER_BYTES whether they
    arrived at once (measured here) or not (h11's incomplete-event limit, set to the same bound):
    `head_too_large` says which refusal a RemoteProtocolError was."""

    def __init__(self) -> None:
        super().__init__(h11.SERVER, max_incomplete_event_size=MAX_HEADER_BYTES)
        self.head_too_large = False

    def next_event(self) -> Any:
        try:
            event = super().next_event()
        except h11.RemoteProtocolError as exc:
            self.head_too_large = exc.error_status_hint == 431  # "Receive buffer too long"
            raise
        if isinstance(event, h11.Request) and head_bytes(event) > MAX_HEADER_BYTES:
            self.head_too_large = True
            raise h11.RemoteProtocolError("request head too large", error_status_hint=431)
        return event


def header_deadline_protocol(read_timeout_s: float) -> type[H11Protocol]:
    """An H11Protocol that closes a connection whose request headers are not complete within
    `read_timeout_s` of the connection opening or of the first bytes of a following request."""
    assert read_timeout_s > 0, read_timeout_s
    body = (
        b'{"error": {"message": "the request headers did not arrive within %g s (read_timeout_s)", '
        b'"type": "invalid_request_error", "param": null, "code": "request_timeout"}}' % read_timeout_s
    )

    class HeaderDeadlineH11(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.conn = _HeadLimitedConnection()

        def send_400_response(self, msg: str) -> None:
            """uvicorn's answer to a request h11 refused; a head over MAX_HEADER_BYTES gets 431 and error JSON."""
            if not self.conn.head_too_large:
                super().send_400_response(msg)
                return
            headers = [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(_TOO_LARGE_BODY)).encode()),
                (b"connection", b"close"),
            ]
            response = h11.Response(
                status_code=431, headers=headers, reason=b"Request Header Fields Too Large"
            )
            for event in (response, h11.Data(data=_TOO_LARGE_BODY), h11.EndOfMessage()):
                self.transport.write(self.conn.send(event))
            self.transport.close()

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is h11.IDLE:  # a request (line or headers) is still incomplete
                self._arm()
            else:
                self._disarm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(read_timeout_s, self._headers_timed_out)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_timed_out(self) -> None:
            self._header_timer = None
            if self.conn.their_state is not h11.IDLE or self.transport.is_closing():
                return
            if self.conn.our_state is h11.IDLE:  # no response under way: say why before closing
                self.transport.write(_TIMEOUT_RESPONSE % (len(body), body))
            self.transport.close()

    return HeaderDeadlineH11


def uvicorn_config(app: Any, read_timeout_s: float, **kwargs: Any) -> uvicorn.Config:
    """uvicorn.Config for `app` over h11 with the header deadline and header size limit."""
    return uvicorn.Config(
        app,
        http=header_deadline_protocol(read_timeout_s),
        h11_max_incomplete_event_size=MAX_HEADER_BYTES,
        **kwargs,
    )
