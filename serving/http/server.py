"""The uvicorn settings kvmem serves with: h11 with a bound on the time a client takes to send its headers.

uvicorn closes idle keep-alive connections, but a connection that sends part of a request line or headers and
stalls is held forever; this protocol closes it (with a 408) `read_timeout_s` after it began sending. The
body's own deadline is serving/http/limits.py's LimitBody. Knows nothing of routes or the app.
"""

from __future__ import annotations

import asyncio
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

MAX_HEADER_BYTES = 16 * 1024  # request line and headers together (h11's incomplete-event limit)
_TIMEOUT_RESPONSE = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
    b"content-length: %d\r\n\r\n%s"
)


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
