"""The worker's synchronous invalidation (on the store's thread) and the delete cascade, mixed into Worker.

Owns applying a store change before the store call returns (a changed memory's block stops serving, every
stored block built from it is deleted, the fence moves), forgetting a user or erased adapters, and the heat
bookkeeping that must never fail the caller. Knows nothing of how blocks are chosen or built, nor of the
queue: the worker's refresh (worker.py) does that, and the caller enqueues it.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

from kvmem.errors import DependencyUnavailable
from scheduler.block_maker import BlockMaker
from scheduler.guard import BlockGuard, Fence
from scheduler.heat import HeatStats, HeatTable
from scheduler.plan import Plan, PlanBook

log = logging.getLogger("scheduler.worker")  # the worker's log, as before this part moved here

_CHANGE_KINDS = {"add": "added", "update": "updated", "delete": "deleted"}


def memory_time(value: Any) -> float:
    """A memory's timestamp (created_at: a number, a datetime or an ISO string) as seconds since the epoch."""
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, datetime):
        return value.timestamp()
    return datetime.fromisoformat(str(value).replace("Z", "+00:00")).timestamp()


class Invalidation:
    """The invalidation on Worker; the worker provides what is declared here."""

    builder: BlockMaker
    heat: HeatTable
    plans: PlanBook
    fence: Fence | None
    guard: BlockGuard
    clock: Callable[[], float]
    _lock: threading.Lock
    _changed: Callable[[str], None]

    # -- invalidation (synchronous, on the store's thread) -------------------------------------------------
    def invalidate(self, event: Any) -> str | None:
        """Apply a store ChangeEvent (or its whole `batch`: every memory one transaction deleted, in one
        cascade). In this order, before returning: if a changed memory is in the user's block, publish a
        block-less plan and drop the item; run the cascade (every stored block built from them); then the heat
        bookkeeping, which is logged and never raised when it fails (a heat store that cannot be written must
        not fail the store call or keep a deleted memory servable). Returns the dropped item id. The caller
        enqueues the rebuild. Raises FenceUnavailable (the cascade's)."""
        kind = _CHANGE_KINDS.get(event.kind, event.kind)
        user_id, now = event.user_id, self.clock()
        ids = tuple(getattr(event, "batch", ()) or (event.memory_id,))
        if kind == "added":
            with self._lock:
                self._bookkeep(user_id, kind, self.heat.seen_many, user_id, [(m, now) for m in ids])
            return None
        dropped = None
        with self._lock:
            self._changed(user_id)
            plan = self.plans.get(user_id)
            if plan.block is not None and not set(ids).isdisjoint(plan.block.memory_ids):
                self.plans.publish(Plan(user_id, None, plan.adapter_id, plan.version + 1, now))
                dropped = plan.block.item_id
        if dropped is not None:
            self.builder.drop_block(dropped)
            log.info("user %r: block %s stopped serving (%d memories %s)", user_id, dropped, len(ids), kind)
        try:
            self._cascade(user_id, list(ids))
        finally:
            with (
                self._lock
            ):  # under the lock: an access event is applied against the heat as it is after this
                if kind == "deleted":
                    self._bookkeep(user_id, kind, self.heat.forget_many, user_id, ids)
                else:
                    self._bookkeep(user_id, kind, self.heat.seen_many, user_id, [(m, now) for m in ids])
        return dropped

    def _prior(self, memory: Any) -> HeatStats:
        """The heat a memory without a row starts from (its row could not be written): the recency prior."""
        at = memory_time(memory.created_at)
        return HeatStats(self.heat.recency_prior, at, 0, 0, at, None, at)

    @staticmethod
    def _bookkeep(user_id: str, kind: str, write: Callable[..., None], *args: Any) -> None:
        """Run a heat write that must not fail the caller: heat is advisory (a lost write costs ranking, not
        correctness), so a failure is logged with its traceback and the call goes on."""
        try:
            write(*args)
        except (sqlite3.Error, OSError, DependencyUnavailable):
            log.exception(
                "user %r: heat bookkeeping for a %s memory failed; serving is unaffected", user_id, kind
            )

    def forget_user(self, user_id: str) -> list[str]:
        """Every stored block of the user stops being served, and is deleted, before this returns."""
        with self._lock:
            self._changed(user_id)
            plan = self.plans.get(user_id)
            if plan.block is not None:
                self.plans.publish(Plan(user_id, None, plan.adapter_id, plan.version + 1, self.clock()))
            self.guard.forget_stamp(user_id)
        if plan.block is not None:
            self.builder.drop_block(plan.block.item_id)
        return self._cascade(user_id, None)

    def _cascade(self, user_id: str, memory_ids: list[str] | None) -> list[str]:
        """DESIGN invariant 5 beyond the current plan: every stored block built from these memories (blocks of
        earlier plans, offline builds, blocks from before a restart or of another replica) is deleted, and
        the shared fence (if any) moves, so other replicas stop serving too. Raises FenceUnavailable."""
        forgotten = self.builder.forget(user_id, memory_ids)
        if forgotten:
            log.info("user %r: %d stored block(s) forgotten: %s", user_id, len(forgotten), forgotten)
        if self.fence is not None:
            self.fence.bump(user_id)
        return forgotten

    def forget_adapters(self, user_id: str, names: Sequence[str]) -> list[str]:
        """The cascade for adapter versions erased from disk: every stored block built under one of them (their
        K/V carry its facts) is deleted before this returns, and the fence moves. Raises FenceUnavailable."""
        forgotten = self.builder.forget_adapters(user_id, list(names)) if names else []
        if forgotten:
            log.info(
                "user %r: %d block(s) under erased adapters forgotten: %s", user_id, len(forgotten), forgotten
            )
            if self.fence is not None:
                self.fence.bump(user_id)
        return forgotten
