"""ASGI middleware of the app: request counts for /metrics, and the replica's name on every answer."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serving.http.metrics import Metrics, route_template


class CountRequests:
    """ASGI middleware: counts every HTTP response by method, route template and status."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            self.metrics.observe_request(scope["method"], route_template(scope.get("route")), status)


class ReplicaHeader:
    """ASGI middleware: every HTTP response says which replica served it (`X-Kvmem-Replica`)."""

    def __init__(self, app: ASGIApp, replica: str) -> None:
        self.app, self.header = app, (b"x-kvmem-replica", replica.encode("ascii"))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_wrapper(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), self.header]}
            await send(message)

        await self.app(scope, receive, send_wrapper)
