"""The overall cap on every user's blocks: drop whole blocks, least valuable per byte first, until they fit.

A part of the worker, mixed into Worker (it runs under its publish lock, on its plans, heat and token
counts), kept apart so worker.py stays readable. Knows nothing of how blocks are built.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from scheduler.block_maker import BlockMaker
from scheduler.config import SchedulerConfig
from scheduler.heat import HeatTable
from scheduler.plan import Plan, PlanBook
from scheduler.policy import BlockUsage, PromotionPolicy, blocks_to_evict


class TotalCap:
    """`enforce_total_cap` on Worker; the worker provides what is declared here."""

    config: SchedulerConfig
    builder: BlockMaker
    heat: HeatTable
    plans: PlanBook
    policy: PromotionPolicy
    clock: Callable[[], float]
    _lock: threading.Lock
    _token_counts: dict[str, dict[str, tuple[int, int]]]

    def enforce_total_cap(self) -> list[str]:
        """Drop whole blocks until every user's blocks fit the overall cap: least valuable per byte first, a
        block's value being the tokens it is expected to serve (heat x tokens, as choose_block weighs it)."""
        now = self.clock()
        usages = []
        for plan in self.plans.all():
            if plan.block is None:
                continue
            stats = self.heat.stats(plan.user_id)
            counts = self._token_counts.get(plan.user_id, {})  # set by the refresh that chose the block
            value = sum(
                self.policy.score(stats[m], now, self.config.half_life_s) * counts.get(m, (0, 1))[1]
                for m in plan.block.memory_ids
                if m in stats
            )
            last = max(
                (stats[m].last_access or 0.0 for m in plan.block.memory_ids if m in stats), default=0.0
            )
            usages.append(BlockUsage(plan.user_id, plan.block.num_bytes, value, last))
        evicted = blocks_to_evict(usages, self.config.total_block_bytes)
        for user_id in evicted:
            with self._lock:
                plan = self.plans.get(user_id)
                self.plans.publish(Plan(user_id, None, plan.adapter_id, plan.version + 1, now))
            if plan.block is not None:
                self.builder.drop_block(plan.block.item_id)
        return evicted
