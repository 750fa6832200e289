"""Keeping published blocks servable: a plan's block is handed out only while the block store has it and,
with replicas, while the shared fence still reads what it read before the block's memories were read.

Owns the fence stamps and the reactions to a block going bad (the store dropped it, a request could not use
it, the fence moved): retract it from the plan under the worker's publish lock, rebuild now or when asked.
Knows nothing of heat or policy; shares the worker's lock, plan book and queue.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Protocol

from scheduler.block_maker import BlockMaker
from scheduler.plan import Plan, PlanBook
from scheduler.queue import Task

log = logging.getLogger(__name__)


class Fence(Protocol):  # scheduler.fence.RedisFence: a generation counter shared by replicas
    def bump(self, user_id: str) -> int: ...
    def read(self, user_id: str) -> int | None: ...
    def retry_pending(self) -> None: ...
    def ping(self) -> None: ...  # raises kvmem.errors.DependencyUnavailable when it cannot be written


class _Queue(Protocol):
    def put(self, task: Task) -> None: ...


class BlockGuard:
    """`unservable_reason` is on the request path (a dict read, the builder's `has_block`, one fence read);
    the rest runs wherever a block goes bad, and publishes under the worker's lock."""

    def __init__(
        self,
        lock: threading.Lock,
        plans: PlanBook,
        queue: _Queue,
        builder: BlockMaker,
        fence: Fence | None,
        clock: Callable[[], float],
    ):
        self._lock, self.plans, self.queue, self.clock = lock, plans, queue, clock
        self.builder, self.fence = builder, fence
        # user -> (their block's item, what the fence read before its memories were read)
        self._stamps: dict[str, tuple[str, int | None]] = {}
        self.evicted: set[str] = set()  # users whose block the store evicted: rebuilt when they next ask
        self._handled: dict[str, str] = {}  # user -> the block whose failure was last acted on

    def stored(self, item_id: str) -> bool:
        return self.builder.has_block(item_id)

    def stamp(self, user_id: str, item_id: str, fenced: int | None) -> None:
        """Record what the fence read before the memories of `item_id` were read. Worker's lock held."""
        self._stamps[user_id] = (item_id, fenced)

    def stamp_of(self, user_id: str) -> tuple[str, int | None] | None:
        """(the user's stamped block, what the fence read before its memories were read), or None. Worker's
        lock held."""
        return self._stamps.get(user_id)

    def forget_stamp(self, user_id: str) -> None:
        self._stamps.pop(user_id, None)

    def forget_user_state(self, user_id: str) -> None:
        """The plan book dropped the user's plan: nothing of theirs is published, so nothing to guard."""
        self._stamps.pop(user_id, None)
        self._handled.pop(user_id, None)
        self.evicted.discard(user_id)

    def unservable_reason(self, plan: Plan, *, check_store: bool = True) -> str | None:
        """Why `plan`'s block must not be served now (None: it may be): "not_found" in the store (asked only
        with `check_store`: the store's call may wait on its lock), "stale" (another replica changed the
        user's memories since it was built), "fence_unreadable"."""
        assert plan.block is not None
        if check_store and not self.builder.has_block(plan.block.item_id):
            return "not_found"
        if self.fence is None:
            return None
        now = self.fence.read(plan.user_id)
        if now is None:
            return "fence_unreadable"
        return None if self._stamps.get(plan.user_id) == (plan.block.item_id, now) else "stale"

    def retract(self, user_id: str, item_id: str, *, rebuild: bool = True) -> bool:
        """Stop serving `item_id` if it is the user's current block: publish the plan without it and, unless
        `rebuild` is False (an eviction: rebuilt when the user next asks, so two users over a small budget do
        not evict each other in a loop), enqueue a rebuild. Idempotent; returns whether the plan changed."""
        with self._lock:
            plan = self.plans.get(user_id)
            hit = plan.block is not None and plan.block.item_id == item_id
            if hit:
                self.plans.publish(Plan(user_id, None, plan.adapter_id, plan.version + 1, self.clock()))
                if not rebuild:
                    self.evicted.add(user_id)
        if hit and rebuild:
            self.queue.put(Task("refresh", user_id))
        return hit

    def withdraw(self, user_id: str, item_id: str, why: str, *, rebuild: bool = True) -> bool:
        """Stop serving a block `unservable_reason` refused for a lasting reason (`why`: "not_found" or
        "stale"); returns whether the plan changed. A stale block is also deleted from the store, its file in
        the shared data dir included: another replica changed the user's memories after it was read (its
        fence bump says so), and the block may hold one that replica deleted, whose cascade ran before this
        block's file was written and so could not delete it."""
        assert why in ("not_found", "stale"), why
        hit = self.retract(user_id, item_id, rebuild=rebuild)
        if hit and why == "stale":
            self.builder.drop_block(item_id)
            log.info("user %r: block %s was built before another replica's change; deleted", user_id, item_id)
        return hit

    def on_dropped(self, item_id: str, user_id: str, reason: str) -> None:
        """The block store dropped an item on its own (builder's `subscribe_dropped`)."""
        if self.retract(user_id, item_id, rebuild=reason != "evicted"):
            self._handled[user_id] = item_id
            log.info(
                "user %r: block %s was dropped by the store (%s); plan without it", user_id, item_id, reason
            )

    def report_unservable(self, user_id: str, item_id: str) -> bool:
        """A request meant to use `item_id` fell back to prefill: drop the block and rebuild it.

        Item ids are content addresses, so by the time a report arrives the id may name the block's fresh
        rebuild. A report of a failure already acted on (the store reported the drop, or another request
        reported it) is therefore taken as that same failure and ignored, once: a rebuild that fails again is
        acted on at its next report. Idempotent and cheap: a dict read, or a plan publish and an enqueue."""
        if self._handled.get(user_id) == item_id:
            self._handled.pop(user_id, None)
            return False
        hit = self.retract(user_id, item_id)
        if hit:
            self._handled[user_id] = item_id
            self.builder.drop_block(item_id)  # a content-addressed rebuild must not find it and reuse it
            log.info("user %r: block %s could not be served; rebuilding", user_id, item_id)
        return hit
