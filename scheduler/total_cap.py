"""The overall cap on every user's blocks: drop whole blocks, least valuable per byte first, until they fit.

A part of the worker (it runs under its publish lock, on its plans, heat and token counts), kept apart so
worker.py stays readable. Knows nothing of how blocks are built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from scheduler.plan import Plan
from scheduler.policy import BlockUsage, blocks_to_evict

if TYPE_CHECKING:
    from scheduler.worker import Worker


def enforce_total_cap(worker: Worker) -> list[str]:
    """Drop whole blocks until every user's blocks fit the overall cap: least valuable per byte first, a
    block's value being the tokens it is expected to serve (heat x tokens, as choose_block weighs it)."""
    now = worker.clock()
    usages = []
    for plan in worker.plans.all():
        if plan.block is None:
            continue
        stats = worker.heat.stats(plan.user_id)
        counts = worker._token_counts.get(plan.user_id, {})  # set by the refresh that chose the block
        value = sum(
            worker.policy.score(stats[m], now, worker.config.half_life_s) * counts.get(m, (0, 1))[1]
            for m in plan.block.memory_ids
            if m in stats
        )
        last = max((stats[m].last_access or 0.0 for m in plan.block.memory_ids if m in stats), default=0.0)
        usages.append(BlockUsage(plan.user_id, plan.block.num_bytes, value, last))
    evicted = blocks_to_evict(usages, worker.config.total_block_bytes)
    for user_id in evicted:
        with worker._lock:
            plan = worker.plans.get(user_id)
            worker.plans.publish(Plan(user_id, None, plan.adapter_id, plan.version + 1, now))
        if plan.block is not None:
            worker.builder.drop_block(plan.block.item_id)
    return evicted
