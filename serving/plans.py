"""Plans: which of a user's memories are served from a KV block, behind a small provider interface.

`StandInPlanProvider` is the placeholder until the scheduler lands: a user's most recent memories up to a
token budget, built once in a background thread and reused; dropped as soon as one of its memories changes.
`get` and `record_access` never block. It knows nothing of HTTP or of how a block is built.
"""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Protocol

from serving.backends.base import Backend

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Plan:
    """An immutable snapshot of what is accelerated for one user. No block: block_item_id is None."""

    user_id: str
    block_item_id: str | None = None
    block_memory_ids: tuple[str, ...] = ()
    block_texts: tuple[str, ...] = ()  # exactly the texts the block was built from, in block order
    block_tokens: int = 0
    block_bytes: int = 0
    block_token_ids: tuple[int, ...] = ()  # the block's prompt ids (may be () if the builder gave none)
    adapter_id: str | None = None
    updated_at: datetime | None = None

    def __post_init__(self) -> None:
        assert len(self.block_memory_ids) == len(self.block_texts)
        assert self.block_item_id is not None or not self.block_memory_ids

    @property
    def covered_ids(self) -> frozenset[str]:
        return frozenset(self.block_memory_ids)

    def to_dict(self) -> dict[str, Any]:
        """The `GET /v1/memories/plan` body."""
        return {
            "block": {
                "item_id": self.block_item_id,
                "memory_ids": list(self.block_memory_ids),
                "tokens": self.block_tokens,
                "bytes": self.block_bytes,
                "tier": "kv" if self.block_item_id is not None else "none",
            },
            "adapter": None if self.adapter_id is None else {"id": self.adapter_id, "tier": "lora"},
            "updated_at": None if self.updated_at is None else self.updated_at.isoformat(),
        }


@dataclass(frozen=True)
class AccessEvent:
    """One chat turn's memory use, for the scheduler's heat statistics."""

    user_id: str
    query: str
    retrieved_ids: tuple[str, ...]
    used_ids: tuple[str, ...]
    session_id: str | None = None
    at: datetime = field(default_factory=lambda: datetime.now(timezone.utc))


class PlanProvider(ABC):
    @abstractmethod
    def get(self, user_id: str) -> Plan:
        """The user's current plan. Never blocks; an empty plan (no block) when there is none yet."""

    @abstractmethod
    def record_access(self, event: AccessEvent) -> None:
        """Note a turn's memory use. Never blocks, never raises for a well-formed event."""

    @abstractmethod
    def close(self) -> None:
        """Stop background work. Idempotent."""

    # Not abstract only while the stand-in lives (it builds no stored block to report or forget).
    def report_unservable(self, user_id: str, item_id: str) -> None:  # noqa: B027
        """A request meant to serve block `item_id` fell back to prefill: stop planning it, rebuild. Cheap,
        idempotent, never raises for a stale report. (No-op here: a provider that plans blocks overrides.)"""

    def forget_user(self, user_id: str) -> None:  # noqa: B027
        """All the user's memories were deleted: no block of theirs may be served when this returns, and
        their stored blocks are deleted. (No-op here: a provider that plans blocks overrides.)"""


_KINDS = {"added": "add", "updated": "update", "deleted": "delete"}


def _touched_ids(event: object) -> set[str]:
    """Memory ids an event names: kvmem.text emits one `memory_id` per event; batches carry `memory_ids`."""
    ids = getattr(event, "memory_ids", None)
    if ids is not None:
        return set(ids)
    one = getattr(event, "memory_id", None)
    return {one} if one else set()


class _ChangeEvent(Protocol):  # what kvmem.text's store passes to subscribers
    kind: str  # "add" | "update" | "delete"
    user_id: str
    memory_ids: tuple[str, ...]


class _Store(Protocol):
    def list(
        self, user_id: str, *, session_id: str | None = None, page: int = 1, page_size: int = 20
    ) -> Any: ...
    def subscribe(self, cb: Callable[[Any], None]) -> Callable[[], None]: ...


class StandInPlanProvider(PlanProvider):
    """Most recent memories up to `token_budget` tokens, as one KV block per user, built off the request path.

    State per user: the installed plan, a generation counter bumped by every invalidation (a build started
    under an older generation is discarded, its block dropped), and whether it must be rebuilt. Builds run one
    at a time on a single worker thread, so a discarded build never races the build that replaces it.
    """

    def __init__(
        self,
        store: _Store,
        backend: Backend,
        *,
        token_budget: int,
        max_candidates: int = 200,
        clock: Callable[[], datetime] = lambda: datetime.now(timezone.utc),
        max_events: int = 1000,
    ) -> None:
        self._store, self._backend, self._budget, self._clock = store, backend, token_budget, clock
        self._max_candidates = max_candidates
        self._lock = threading.Lock()
        self._plans: dict[str, Plan] = {}
        self._generation: dict[str, int] = {}
        self._stale: set[str] = set()  # users whose plan must be (re)built on the next get
        self._building: set[str] = set()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvmem-plan")
        self._closed = False
        self.events: deque[AccessEvent] = deque(maxlen=max_events)
        self._unsubscribe = store.subscribe(self._on_change)

    def get(self, user_id: str) -> Plan:
        with self._lock:
            plan = self._plans.get(user_id)
            needs_build = (plan is None or user_id in self._stale) and user_id not in self._building
            if needs_build and self._budget > 0 and not self._closed and self._backend.is_ready():
                self._building.add(user_id)
                self._stale.discard(user_id)
                self._executor.submit(self._build, user_id, self._generation.get(user_id, 0))
        return plan if plan is not None else Plan(user_id=user_id)

    def record_access(self, event: AccessEvent) -> None:
        self.events.append(event)

    def flush(self) -> None:
        """Wait until the builds queued so far are done (for tests and shutdown)."""
        if not self._closed:
            self._executor.submit(lambda: None).result()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._unsubscribe()
        self._executor.shutdown(wait=True, cancel_futures=True)

    # -- background ------------------------------------------------------------------------------------------
    def _choose(self, user_id: str) -> tuple[list[str], list[str], int]:
        """Newest first, skipping any memory that would overflow the budget."""
        ids, texts, used_tokens, page = [], [], 0, 1
        while (page - 1) * 100 < self._max_candidates:
            result = self._store.list(user_id, page=page, page_size=100)
            for memory in result.items:
                num_tokens = self._backend.count_tokens(memory.text)
                if used_tokens + num_tokens <= self._budget:
                    ids.append(memory.id)
                    texts.append(memory.text)
                    used_tokens += num_tokens
            if page * result.page_size >= result.total:
                break
            page += 1
        return ids, texts, used_tokens

    def _build(self, user_id: str, generation: int) -> None:
        try:
            ids, texts, _ = self._choose(user_id)
            info = self._backend.build_block(user_id, texts, ids) if ids else None
        except Exception:
            logger.exception(
                "building the stand-in plan for user %r failed; serving memories as text", user_id
            )
            with self._lock:
                self._building.discard(user_id)
                self._plans.setdefault(user_id, Plan(user_id=user_id))
            return
        plan = Plan(user_id=user_id, updated_at=self._clock())
        if info is not None:
            plan = Plan(
                user_id=user_id,
                block_item_id=info.item_id,
                block_memory_ids=tuple(ids),
                block_texts=tuple(texts),
                block_tokens=info.num_tokens,
                block_bytes=info.num_bytes,
                block_token_ids=info.token_ids,
                updated_at=self._clock(),
            )
        with self._lock:
            self._building.discard(user_id)
            current = self._generation.get(user_id, 0) == generation
            if current:
                self._plans[user_id] = plan
        if not current and info is not None:
            self._backend.drop_block(info.item_id)
        elif current:
            logger.info(
                "plan for user %r: %d memories, %d tokens in KV", user_id, len(ids), plan.block_tokens
            )

    def _on_change(self, event: _ChangeEvent) -> None:
        """Store callback. For update/delete, the old block stops being served before this returns."""
        dropped: str | None = None
        with self._lock:
            user_id = event.user_id
            plan = self._plans.get(user_id)
            kind = _KINDS.get(event.kind, event.kind)
            if kind == "add":
                if plan is not None and plan.block_item_id is None:
                    self._stale.add(user_id)  # it had nothing to accelerate; now it may
                return
            self._generation[user_id] = self._generation.get(user_id, 0) + 1
            touched = _touched_ids(event)  # empty: the user's memories were all deleted
            if (
                plan is not None
                and plan.block_item_id is not None
                and (not touched or plan.covered_ids & touched)
            ):
                self._plans[user_id] = Plan(user_id=user_id, updated_at=self._clock())
                self._stale.add(user_id)
                dropped = plan.block_item_id
            elif user_id in self._building:
                self._stale.add(user_id)
        if dropped is not None:
            self._backend.drop_block(dropped)
            logger.info(
                "plan for user %r invalidated by a %s; block %s dropped", user_id, event.kind, dropped
            )
