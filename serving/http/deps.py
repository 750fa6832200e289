"""The routes' shared request parameters: the caller (from the Authorization header), a user id in the query,
and the Idempotency-Key header of memory writes.

Owns how each is read and bounded; what a caller may do is auth.py's, what a repeated key answers
idempotency.py's. Knows nothing of the routes that take them.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Header, Query, Request

from serving.http.auth import ANYONE, Caller, KeyRing
from serving.http.idempotency import MAX_KEY_CHARS

UserId = Annotated[str, Query(min_length=1, max_length=256)]
# memory writes: a repeat with the same key (same user, method and path) gets the first answer
IdempotencyKey = Annotated[
    str | None, Header(alias="Idempotency-Key", min_length=1, max_length=MAX_KEY_CHARS)
]


def _caller(request: Request, authorization: Annotated[str | None, Header()] = None) -> Caller:
    keyring: KeyRing | None = request.app.state.keyring
    return keyring.caller(authorization) if keyring is not None else ANYONE


CallerDep = Annotated[Caller, Depends(_caller)]
