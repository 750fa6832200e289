"""Memory writes a client may retry: `Idempotency-Key` answers, and writes reported as committed even when a
post-commit hook failed.

IdempotentWrites keeps the first successful answer per (user, method, path, key) in the store's own database
(kvmem.text.keyed_writes), recorded in the write's own transaction: a retry through another replica sharing
the store (HAProxy retries and redispatches) finds it and writes nothing, and a write that committed always has
its answer. Answers expire after `ttl_s`. `committed_write` runs a store write (under the keyed request's claim,
when there is one) and, when only a change subscriber raised (SubscriberError: the write stands), returns what
was committed, read back from the change events, instead of an error. Knows nothing of routes or HTTP beyond
the ApiError it raises for a key reused with a different request.
"""

from __future__ import annotations

import asyncio
import contextvars
import hashlib
import json
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

from kvmem.text import ChangeEvent, SubscriberError
from kvmem.text.keyed_writes import Receipt, ReceiptClaim, ReceiptTaken, TxView
from serving.http.protocol import ApiError

logger = logging.getLogger(__name__)

DEFAULT_TTL_S = 24 * 3600.0  # a key answers its repeats for a day
PRUNE_EVERY_S = 3600.0  # how often a server deletes expired answers from the store
MAX_KEY_CHARS = 256

# The claim of the keyed write the current request runs (asyncio.to_thread copies it into the worker thread
# that makes the store write): EventCollector.committed_write records its receipt in that write's transaction.
_CLAIM: contextvars.ContextVar[tuple[Any, ReceiptClaim] | None] = contextvars.ContextVar(
    "kvmem_receipt_claim", default=None
)


@dataclass(frozen=True)
class Answer:
    """A write route's answer: its status and JSON body."""

    status: int
    body: dict[str, Any]


def fingerprint(*parts: Any) -> str:
    """A digest of what a request asked (its body and query): a key reused for another request is refused."""
    text = json.dumps(parts, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _key_reused() -> ApiError:
    return ApiError(
        400,
        "this Idempotency-Key was used for a different request; use a new key",
        type="invalid_request_error",
        code="idempotency_key_reused",
        param="Idempotency-Key",
    )


class IdempotentWrites:
    """The first 2xx answer per key, kept in the store and replayed to repeats from any process sharing it.
    Errors are not kept: a failed write may be retried.

    A repeat that arrives at this process while the first is still running waits for it; one that reaches
    another replica meanwhile is serialized by the store's write lock, finds the first's receipt in its own
    transaction and is rolled back (ReceiptTaken), then replayed. Event-loop only (not thread-safe).
    """

    def __init__(
        self, store: Any, ttl_s: float = DEFAULT_TTL_S, clock: Callable[[], float] = time.time
    ) -> None:
        """`clock`: wall-clock seconds (replicas compare the times they record)."""
        assert ttl_s > 0, ttl_s
        self.store, self.ttl_s, self._clock = store, ttl_s, clock
        self._in_flight: dict[tuple[str, ...], asyncio.Future[None]] = {}
        self._pruned_at_s: float | None = None

    async def run(
        self,
        user_id: str,
        scope: str,
        key: str,
        request_fingerprint: str,
        write: Callable[[], Awaitable[Answer]],
        answer: Callable[[TxView], Answer],
    ) -> tuple[Answer, bool]:
        """The answer to a keyed write, and True when it was replayed. `write()` makes the store write (through
        EventCollector.committed_write) and answers from its return value; `answer(view)` gives the same
        answer from inside the write's transaction (its change events and rows), which is what is recorded and
        returned. Raises ApiError 400 `idempotency_key_reused` when `key` was used for a request with another
        fingerprint."""
        flight = (user_id, scope, key)
        while (pending := self._in_flight.get(flight)) is not None:
            await asyncio.shield(pending)  # the first attempt's outcome decides: replay it or run again
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._in_flight[flight] = done
        try:
            found = await asyncio.to_thread(
                self.store.find_receipt, user_id, scope, key, self._clock(), self.ttl_s
            )
            if found is not None:
                return self._replay(found, request_fingerprint), True
            claim = ReceiptClaim(
                user_id,
                scope,
                key,
                request_fingerprint,
                lambda view: _as_pair(answer(view)),
                now_s=self._clock(),
                ttl_s=self.ttl_s,
            )
            token = _CLAIM.set((self.store, claim))
            try:
                answered = await write()
            except ReceiptTaken as taken:  # another replica committed this key first: nothing was written
                return self._replay(taken.receipt, request_fingerprint), True
            finally:
                _CLAIM.reset(token)
            answered = await self._recorded(claim, answered)
            await self._prune()
            return answered, False
        finally:
            del self._in_flight[flight]
            done.set_result(None)

    def _replay(self, receipt: Receipt, request_fingerprint: str) -> Answer:
        if receipt.fingerprint != request_fingerprint:
            raise _key_reused()
        return Answer(receipt.status, receipt.body)

    async def _recorded(self, claim: ReceiptClaim, answered: Answer) -> Answer:
        """The answer as recorded in the write's transaction, with the warning of a post-commit hook that
        failed after it (amended into the receipt, so repeats say it too)."""
        if not 200 <= answered.status < 300:
            return answered
        if claim.receipt is None:  # the call committed no write transaction: record its answer on its own
            claim.answer = lambda view: _as_pair(answered)
            receipt = await asyncio.to_thread(self.store.record_receipt, claim)
            return Answer(receipt.status, receipt.body)
        receipt = claim.receipt
        warnings = answered.body.get("warnings")
        if warnings is None or "warnings" in receipt.body:
            return Answer(receipt.status, receipt.body)
        body = {**receipt.body, "warnings": warnings}
        try:
            await asyncio.to_thread(self.store.amend_receipt, claim, body)
        except Exception:  # the write and its answer stand; a repeat's answer lacks only the warning
            logger.exception("could not add a hook's warning to a keyed write's recorded answer")
        return Answer(receipt.status, body)

    async def _prune(self) -> None:
        """Deletes expired answers from the store, at most every PRUNE_EVERY_S; a failure is logged."""
        now = self._clock()
        if self._pruned_at_s is not None and now - self._pruned_at_s < PRUNE_EVERY_S:
            return
        self._pruned_at_s = now
        try:
            await asyncio.to_thread(self.store.prune_receipts, now - self.ttl_s)
        except Exception:
            logger.exception(
                "pruning expired Idempotency-Key answers failed; retried in %.0f s", PRUNE_EVERY_S
            )


def _as_pair(answer: Answer) -> tuple[int, dict[str, Any]]:
    return answer.status, answer.body


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
        """Run `write(*args, **kwargs)` (blocking; call it in a worker thread), under the claim of the keyed
        request it serves, if any (IdempotentWrites.run). A SubscriberError (the write was committed, a hook
        such as the scheduler's failed) is returned as `hook_error`, not raised."""
        keyed = _CLAIM.get()
        under_claim = keyed[0].keyed_write(keyed[1]) if keyed is not None else nullcontext()
        with self.collect() as events, under_claim:
            try:
                value = write(*args, **kwargs)
            except SubscriberError as e:
                logger.error("a write was committed but a post-commit hook failed: %s", e)
                return Committed(None, tuple(events), str(e))
            return Committed(value, tuple(events), None)
