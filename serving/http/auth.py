"""API keys: which bearer key may act for which user ids.

The keys file is JSON: `{"keys": {"sk-abc...": ["alice", "bob"], "sk-def...": ["carol"]}}`. A key acts
only for the users listed with it. With auth off (loopback demo mode) any user id is accepted, but only from
requests whose `Host` is a loopback name (CheckHost: DNS rebinding would otherwise let any web page in).
"""

from __future__ import annotations

import hmac
import ipaddress
import json
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

from starlette.types import ASGIApp, Receive, Scope, Send

from serving.config import is_loopback
from serving.http.protocol import ApiError


class KeysFileError(ValueError):
    """The API keys file is missing or not in the documented shape."""


@dataclass(frozen=True)
class Caller:
    """Who is calling: the users they may act for (None: anyone, auth off)."""

    allowed_users: frozenset[str] | None

    def may_act_for(self, user_id: str) -> bool:
        return self.allowed_users is None or user_id in self.allowed_users


ANYONE = Caller(allowed_users=None)


@dataclass(frozen=True)
class KeyRing:
    keys: tuple[tuple[str, frozenset[str]], ...]

    @classmethod
    def from_file(cls, path: Path) -> KeyRing:
        try:
            raw = json.loads(Path(path).read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise KeysFileError(
                f"API keys file {str(path)!r} does not exist (or start with --no-auth)"
            ) from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise KeysFileError(f"API keys file {str(path)!r} is not readable JSON: {e}") from None
        return cls.from_mapping(raw.get("keys") if isinstance(raw, dict) else None, source=str(path))

    @classmethod
    def from_mapping(cls, keys: object, *, source: str = "keys") -> KeyRing:
        if not isinstance(keys, dict) or not keys:
            raise KeysFileError(
                f'{source}: expected {{"keys": {{"<key>": ["<user id>", ...]}}}} with >= 1 key'
            )
        out = []
        for key, users in keys.items():
            if not isinstance(key, str) or len(key) < 8:
                raise KeysFileError(f"{source}: every key must be a string of >= 8 characters")
            if not isinstance(users, list) or not all(isinstance(u, str) and u for u in users):
                raise KeysFileError(f"{source}: the users of each key must be a list of non-empty strings")
            out.append((key, frozenset(users)))
        return cls(keys=tuple(out))

    def caller(self, authorization: str | None) -> Caller:
        """The caller for an `Authorization` header value. Raises ApiError 401 if missing or unknown."""
        if not authorization:
            raise ApiError(
                401,
                "missing API key: send 'Authorization: Bearer <key>'",
                type="authentication_error",
                code="missing_api_key",
            )
        scheme, _, token = authorization.partition(" ")
        token = token.strip()
        found = None
        if scheme.lower() == "bearer" and token:
            for key, users in self.keys:  # compare against every key: no early exit to time
                if hmac.compare_digest(key.encode(), token.encode()):
                    found = users
        if found is None:
            raise ApiError(
                401, "incorrect API key provided", type="authentication_error", code="invalid_api_key"
            )
        return Caller(allowed_users=found)


def check_user(caller: Caller, user_id: str, *, param: str = "user_id") -> None:
    """Raises ApiError 403 unless the caller may act for `user_id`."""
    if not caller.may_act_for(user_id):
        raise ApiError(
            403,
            f"this API key may not act for user {user_id!r}",
            type="permission_error",
            code="user_not_allowed",
            param=param,
        )


def host_name(host_header: str) -> str:
    """The name in a `Host` header, without its port, brackets or trailing dot, lowercased."""
    host = host_header.strip().lower()
    if host.startswith("["):  # [::1]:8000
        return host[1:].partition("]")[0]
    if host.count(":") == 1:  # name:port (a bare IPv6 address has several colons)
        host = host.partition(":")[0]
    return host.rstrip(".")


def host_allowed(host_header: str, extra: Collection[str] = ()) -> bool:
    """A loopback name (localhost, 127.0.0.1, ::1, any port) or one of `extra` (names, lowercase)."""
    name = host_name(host_header)
    return is_loopback(name) or name in extra


def _is_ip(host: object) -> bool:
    try:
        ipaddress.ip_address(str(host))
    except ValueError:
        return False
    return True


class CheckHost:
    """ASGI middleware for auth-off mode: refuses (403 `host_not_allowed`) a request over TCP whose `Host` is
    not a loopback name nor in `allowed_hosts`, so a web page whose domain was rebound to 127.0.0.1 cannot
    read or delete memories. What it checks is the server socket's own address in the scope (an IP address
    under uvicorn, which no request header can change): in-process test clients and Unix sockets, which no
    browser reaches, are let through. A request without a `Host` header (HTTP/1.0) is checked as ''."""

    def __init__(
        self, app: ASGIApp, allowed_hosts: Collection[str], respond: Callable[[Exception], ASGIApp]
    ) -> None:
        self.app, self.respond = app, respond
        self.allowed_hosts = frozenset(h.lower() for h in allowed_hosts)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        server = scope.get("server")
        if scope["type"] in ("http", "websocket") and server and _is_ip(server[0]):
            host = next((v.decode("latin-1") for k, v in scope.get("headers", ()) if k == b"host"), "")
            if not host_allowed(host, self.allowed_hosts):
                refusal = ApiError(
                    403,
                    f"host {host_name(host)!r} is not allowed: with auth off only loopback host names are "
                    "answered (start with --allowed-hosts to add names)",
                    type="permission_error",
                    code="host_not_allowed",
                )
                await self.respond(refusal)(scope, receive, send)
                return
        await self.app(scope, receive, send)
