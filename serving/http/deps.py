"""The routes' shared request parameters: the caller (from the Authorization header), a user id in the query,
the user header a chat may name its user by (the one the router hashes on), and the Idempotency-Key header of
memory writes.

Owns how each is read and bounded; what a caller may do is auth.py's, what a repeated key answers
idempotency.py's. Knows nothing of the routes that take them.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Header, Query, Request

from serving.http.auth import ANYONE, Caller, KeyRing
from serving.http.idempotency import MAX_KEY_CHARS
from serving.http.protocol import NON_BLANK, bad_request

# The user header: the chat route's user when the body names none, and what the router (deploy/haproxy.cfg)
# hashes on. X-User-Id is its deprecated alias (read by both, so an old client is still routed by its user).
USER_HEADER = "X-Kvmem-User"
DEPRECATED_USER_HEADER = "X-User-Id"

UserId = Annotated[str, Query(min_length=1, max_length=256, pattern=NON_BLANK)]
SessionId = Annotated[str | None, Query(min_length=1, max_length=256, pattern=NON_BLANK)]
# an ISO 8601 time (the store parses it and names the parameter it refuses); documented as RFC 3339 date-time
TimeParam = Annotated[str | None, Query(max_length=64, json_schema_extra={"format": "date-time"})]
# memory writes: a repeat with the same key (same user, method and path) gets the first answer
IdempotencyKey = Annotated[
    str | None, Header(alias="Idempotency-Key", min_length=1, max_length=MAX_KEY_CHARS)
]


def _caller(request: Request, authorization: Annotated[str | None, Header()] = None) -> Caller:
    keyring: KeyRing | None = request.app.state.keyring
    return keyring.caller(authorization) if keyring is not None else ANYONE


CallerDep = Annotated[Caller, Depends(_caller)]


def _header_user(
    x_kvmem_user: Annotated[str | None, Header(alias=USER_HEADER, max_length=256)] = None,
    x_user_id: Annotated[
        str | None, Header(alias=DEPRECATED_USER_HEADER, max_length=256, deprecated=True)
    ] = None,
) -> str | None:
    """The user the user header names (X-Kvmem-User, or its deprecated alias X-User-Id); None if neither is
    sent. Both, naming different users, is 400: the router would hash one and the server act for the other."""
    if x_kvmem_user is not None and x_user_id is not None and x_kvmem_user != x_user_id:
        raise bad_request(
            f"{USER_HEADER} names {x_kvmem_user!r} but {DEPRECATED_USER_HEADER} names {x_user_id!r}: send one "
            f"({DEPRECATED_USER_HEADER} is a deprecated alias of {USER_HEADER})",
            param=USER_HEADER,
            code="conflicting_user_headers",
        )
    return x_kvmem_user if x_kvmem_user is not None else x_user_id


HeaderUser = Annotated[str | None, Depends(_header_user)]
