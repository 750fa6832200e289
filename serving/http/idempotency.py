"""Memory writes a client may retry: `Idempotency-Key` answers, and writes reported as committed even when a
post-commit hook failed.

IdempotencyCache keeps the first successful answer per (user, method, path, key) in this process's memory,
for `ttl_s` and at most `max_entries`: the retry it serves comes seconds after a lost answer, to the same
server, and a table in the store's SQLite file could not be written in the memory write's own transaction
(the store owns its file), so it would add a second commit that can fail after the first. A restart forgets
the keys. `committed_write` runs a store write and, when only a change subscriber raised (SubscriberError:
the write stands), returns what was committed, read back from the change events, instead of an error.
Knows nothing of routes or HTTP beyond the ApiError it raises for a key reused with a different request.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from kvmem.text import ChangeEvent, SubscriberError
from serving.http.protocol import ApiError

logger = logging.getLogger(__name__)

DEFAULT_TTL_S = 24 * 3600.0  # a key answers its repeats for a day
DEFAULT_MAX_ENTRIES = 10_000  # past this, the oldest keys are forgotten first
MAX_KEY_CHARS = 256


@dataclass(frozen=True)
class Answer:
    """A write route's answer: its status and JSON body."""

    status: int
    body: dict[str, Any]


@dataclass(frozen=True)
class _Entry:
    fingerprint: str
    answer: Answer
    stored_at_s: float


def fingerprint(*parts: Any) -> str:
    """A digest of what a request asked (its body and query): a key reused for another request is refused."""
    text = json.dumps(parts, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


class IdempotencyCache:
    """The first 2xx answer per key, replayed to repeats. Errors are not kept: a failed write may be retried.

    A repeat that arrives while the first is still running waits for it. Event-loop only (not thread-safe).
    """

    def __init__(
        self,
        ttl_s: float = DEFAULT_TTL_S,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        assert ttl_s > 0 and max_entries >= 1, (ttl_s, max_entries)
        self.ttl_s, self.max_entries, self._clock = ttl_s, max_entries, clock
        self._entries: OrderedDict[tuple[str, ...], _Entry] = OrderedDict()  # oldest first
        self._in_flight: dict[tuple[str, ...], asyncio.Future[None]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    async def run(
        self, key: tuple[str, ...], request_fingerprint: str, write: Callable[[], Awaitable[Answer]]
    ) -> tuple[Answer, bool]:
        """`write()`'s answer, or the answer stored for `key`; True when replayed. Raises ApiError 400
        `idempotency_key_reused` when `key` was used for a request with another fingerprint."""
        while True:
            entry = self._get(key)
            if entry is not None:
                if entry.fingerprint != request_fingerprint:
                    raise ApiError(
                        400,
                        "this Idempotency-Key was used for a different request; use a new key",
                        type="invalid_request_error",
                        code="idempotency_key_reused",
                        param="Idempotency-Key",
                    )
                return entry.answer, True
            pending = self._in_flight.get(key)
            if pending is None:
                break
            await asyncio.shield(pending)  # the first attempt's outcome decides: replay it or run again
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._in_flight[key] = done
        try:
            answer = await write()
            if 200 <= answer.status < 300:
                self._put(key, _Entry(request_fingerprint, answer, self._clock()))
            return answer, False
        finally:
            del self._in_flight[key]
            done.set_result(None)

    def _get(self, key: tuple[str, ...]) -> _Entry | None:
        entry = self._entries.get(key)
        if entry is not None and self._clock() - entry.stored_at_s > self.ttl_s:
            del self._entries[key]
            return None
        return entry

    def _put(self, key: tuple[str, ...], entry: _Entry) -> None:
        self._entries[key] = entry
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)


@dataclass(frozen=True)
class Committed:
    """A store write's outcome: its return value (None when a hook failed), the change events it committed,
    and the failed hook's error (None: every subscriber ran)."""

    value: Any
    events: tuple[ChangeEvent, ...]
    hook_error: str | None


class EventCollector:
    """A store subscriber that hands the events of a write to the thread that made it (subscribers run in
    the writing thread, after commit)."""

    def __init__(self) -> None:
        self._local = threading.local()

    def __call__(self, event: ChangeEvent) -> None:
        events = getattr(self._local, "events", None)
        if events is not None:
            events.append(event)

    @contextmanager
    def collect(self) -> Iterator[list[ChangeEvent]]:
        self._local.events = events = []
        try:
            yield events
        finally:
            self._local.events = None

    def committed_write(self, write: Callable[..., Any], *args: Any, **kwargs: Any) -> Committed:
        """Run `write(*args, **kwargs)` (blocking; call it in a worker thread). A SubscriberError (the write
        was committed, a hook such as the scheduler's failed) is returned as `hook_error`, not raised."""
        with self.collect() as events:
            try:
                value = write(*args, **kwargs)
            except SubscriberError as e:
                logger.error("a write was committed but a post-commit hook failed: %s", e)
                return Committed(None, tuple(events), str(e))
            return Committed(value, tuple(events), None)
