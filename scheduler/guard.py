"""Keeping published blocks servable: a plan's block is handed out only while the block store has it.

Owns the reactions to a block going bad (the store dropped it, a request could not use it): retract it
from the plan under the worker's publish lock, rebuild now or when asked.
Knows nothing of heat or policy; shares the worker's lock, plan book and queue.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, Protocol

from scheduler.plan import Plan, PlanBook
from scheduler.queue import Task

log = logging.getLogger(__name__)


class _Queue(Protocol):
    def put(self, task: Task) -> None: ...


class BlockGuard:
    """`unservable_reason` is on the request path (a dict read and the builder's `has_block`);
    the rest runs wherever a block goes bad, and publishes under the worker's lock."""

    def __init__(
        self,
        lock: threading.Lock,
        plans: PlanBook,
        queue: _Queue,
        builder: Any,  # worker.BlockBuilder; optional has_block
        clock: Callable[[], float],
    ):
        self._lock, self.plans, self.queue, self.clock = lock, plans, queue, clock
        self.builder = builder
        self._has_block: Callable[[str], bool] | None = getattr(builder, "has_block", None)
        self.evicted: set[str] = set()  # users whose block the store evicted: rebuilt when they next ask
        self._handled: dict[str, str] = {}  # user -> the block whose failure was last acted on

    def stored(self, item_id: str) -> bool:
        return self._has_block is None or self._has_block(item_id)

    def unservable_reason(self, plan: Plan) -> str | None:
        """Why `plan`'s block must not be served now (None: it may be): "not_found" in the store."""
        assert plan.block is not None
        if self._has_block is not None and not self._has_block(plan.block.item_id):
            return "not_found"
        return None

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
