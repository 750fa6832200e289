"""Schemathesis hooks for test_fuzz.py's `--checks all` run (loaded through SCHEMATHESIS_HOOKS): the rules the
server enforces across fields, headers or requests, which an OpenAPI schema cannot state. Each turns a
generated request that the schema allows but such a rule refuses (with its own documented 400) into one the
rule allows; a value that is itself invalid (a negative case's mutation) is left as it is.

- An Idempotency-Key is bound to its first request: the same key with another request is 400
  `idempotency_key_reused` (the generator reuses its few short keys): each request gets a key of its own.
- X-User-Id is X-Kvmem-User's deprecated alias: both, naming different users, is 400 conflicting_user_headers.
- A search's `filters.time_range` with `start` after `end` is 400 (an inverted range): its ends are swapped.
"""

from __future__ import annotations

import uuid
from typing import Any

import schemathesis

from kvmem.text import InvalidMemoryInput
from kvmem.text.filters import parse_time


def _valid_header(value: Any, min_chars: int = 1) -> bool:
    return isinstance(value, str) and min_chars <= len(value) <= 256


def _time(value: Any) -> str | None:
    try:
        return parse_time(value, "t")
    except InvalidMemoryInput:
        return None


@schemathesis.hook
def before_call(context: Any, case: Any, kwargs: dict[str, Any]) -> None:
    """Every phase's request, just before it is sent (the generation hooks do not reach the coverage phase)."""
    headers = case.headers
    if headers:
        if _valid_header(headers.get("Idempotency-Key")):
            headers["Idempotency-Key"] = uuid.uuid4().hex
        alias, user = headers.get("X-User-Id"), headers.get("X-Kvmem-User")
        if _valid_header(alias, 0) and _valid_header(user, 0):
            headers["X-User-Id"] = user
    filters = case.body.get("filters") if isinstance(case.body, dict) else None
    time_range = filters.get("time_range") if isinstance(filters, dict) else None
    if isinstance(time_range, dict):
        start, end = _time(time_range.get("start")), _time(time_range.get("end"))
        if start is not None and end is not None and start > end:
            time_range["start"], time_range["end"] = time_range["end"], time_range["start"]
