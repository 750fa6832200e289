"""The adapter a user's plan serves, as the Scheduler facade sees it, mixed into Scheduler.

Owns the request path's view of a user's served LoRA adapter (a dict read of what the worker last found, or a
fresh check for reads that only look), the worker's recorded read, the poll between tasks that notices an
adapter pointer another process moved, and retracting a block built under an adapter that stopped. Knows
nothing of how adapters are trained, stored or checked (kvmem.adapters.ActiveAdapters does that).
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

from scheduler.block_maker import BlockMaker
from scheduler.plan import AdapterPlan, Plan, PlanBook
from scheduler.queue import Task
from scheduler.worker import TaskQueue, Worker

ADAPTER_POLL_S = 1.0  # how often the worker stats held users' adapter pointers (another process may move one)


class ServedAdapters:
    """The served adapter on Scheduler; the facade provides what is declared here."""

    adapters: Any  # kvmem.adapters.ActiveAdapters, or None: no parametric tier
    builder: BlockMaker
    plans: PlanBook
    queue: TaskQueue
    worker: Worker
    _adapters_polled: float

    def served_adapter(self, user_id: str, *, fresh: bool = True) -> AdapterPlan | None:
        """The user's served adapter, or None; None too when the builder's backend applies no adapter (its
        `serves_adapters`): the adapter's facts then stay in the user's block or go as text. `fresh`
        (a plan read, the distillation sweep): a pointer stat, and a version's check when it changed
        (ActiveAdapters.check), not recorded, so the worker still notices the move and rebuilds (`poll_adapters`);
        else what the worker last found, a dict read (ActiveAdapters.peek)."""
        if not self._serves_adapters():
            return None
        return _adapter_plan(self.adapters.check(user_id) if fresh else self.adapters.peek(user_id).manifest)

    def _worker_adapter(self, user_id: str) -> AdapterPlan | None:
        """The worker's read of the user's served adapter (ActiveAdapters.get): recorded, since the refresh that
        asks for it acts on it (builds the block under it, or without its facts)."""
        return _adapter_plan(self.adapters.get(user_id)) if self._serves_adapters() else None

    def _serves_adapters(self) -> bool:
        return self.adapters is not None and self.builder.serves_adapters

    def _with_adapter(self, plan: Plan) -> tuple[bool, Plan]:
        """`plan` with the adapter the worker last found served (one stat of the pointer file, no registry
        read, no hash), and whether that is checked. A pointer moved since (another process activated or
        rolled back a version, or the cascade stopped one) is unchecked: the plan then serves neither an
        adapter nor a block (text) until the worker's check (ActiveAdapters.get)."""
        if not self._serves_adapters():
            return True, plan if plan.adapter is None else replace(plan, adapter=None, adapter_id=None)
        seen = self.adapters.peek(plan.user_id)
        if not seen.current:
            return False, replace(plan, block=None, adapter=None, adapter_id=None)
        adapter = _adapter_plan(seen.manifest)
        if adapter is None:
            return True, plan if plan.adapter is None else replace(plan, adapter=None, adapter_id=None)
        return True, replace(plan, adapter=adapter, adapter_id=adapter.adapter_id)

    def _drop_adapter_block(self, user_id: str) -> None:
        """The user's adapter stopped: a block built under it (its K/V carry the adapter's facts) stops being
        served and is deleted before the store call returns."""
        block = self.plans.get(user_id).block
        if block is not None and block.adapter is not None:
            self.worker.guard.retract(user_id, block.item_id)
            self.builder.drop_block(block.item_id)

    def poll_adapters(self, *, force: bool = False) -> list[str]:
        """At most every `ADAPTER_POLL_S` (unless `force`), on the worker: stat the adapter pointer of every user
        the plan book holds (ActiveAdapters.get; a new version is checked here, hashes included, never on the
        request path) and enqueue a refresh for each user whose served adapter changed. Returns those users."""
        now = time.monotonic()
        if self.adapters is None or (not force and now - self._adapters_polled < ADAPTER_POLL_S):
            return []
        self._adapters_polled = now
        changed = []
        for user_id in self.plans.users():
            seen = self.adapters.peek(user_id)
            if seen.current:
                continue
            after = self.adapters.get(user_id)
            if (seen.manifest and seen.manifest.name) != (after and after.name):
                changed.append(user_id)
                self.queue.put(Task("refresh", user_id))
        return changed


def _adapter_plan(manifest: Any) -> AdapterPlan | None:
    """The plan's view of an adapter manifest (kvmem.adapters.AdapterManifest), or None."""
    if manifest is None:
        return None
    return AdapterPlan(
        manifest.adapter_id,
        manifest.version,
        manifest.name,
        manifest.served_memory_ids,
        manifest.memory_ids,
    )
