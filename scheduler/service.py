"""The scheduler: heat + policy + plans + a worker thread that builds blocks off the request path.

Request path: `get` (a dict read) and `record_access` / `session_start` (an enqueue). Store changes arrive
through `on_change`, which stops serving an affected block *before it returns* and leaves the rebuild to the
worker. A per-user generation counter makes a rebuild that raced a change discard its result, so a deleted
memory never appears in a published block. Knows nothing of HTTP; blocks are built by an injected builder.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

from scheduler.config import SchedulerConfig
from scheduler.heat import HeatTable
from scheduler.plan import BlockPlan, Plan, PlanBook
from scheduler.policy import (
    BlockUsage,
    Candidate,
    blocks_to_evict,
    choose_block,
    distill_candidates,
    promotion_policy,
)
from scheduler.queue import Task, make_queue

log = logging.getLogger(__name__)


class BuiltBlock(Protocol):
    item_id: str
    num_tokens: int
    num_bytes: int


class BlockBuilder(Protocol):
    def ready(self) -> bool: ...
    def build_block(self, user_id: str, texts: Sequence[str], memory_ids: Sequence[str]) -> BuiltBlock: ...
    def drop_block(self, item_id: str) -> None: ...

    # optional: `warm_block(item_id)` moves a stored block to the fastest tier (called on session start)


class MemorySource(Protocol):  # kvmem.text.MemoryStore satisfies it
    def list(
        self, user_id: str, *, session_id: str | None = None, page: int = 1, page_size: int = 20
    ) -> Any: ...
    def subscribe(self, callback: Callable[[Any], None]) -> Callable[[], None]: ...


@dataclass(frozen=True)
class AccessEvent:
    user_id: str
    retrieved_ids: tuple[str, ...]
    used_ids: tuple[str, ...]
    at: float
    session_id: str | None = None


@dataclass(frozen=True)
class SchedulerStats:
    num_blocks: int
    block_tokens: int
    block_bytes: int
    plan_reads: int
    plan_hits: int  # reads that found a block
    queue_depth: int
    tasks_done: int
    task_p50_s: float
    task_max_s: float
    builds: int
    discarded_builds: int
    distill_candidates: int

    @property
    def hit_rate(self) -> float:
        return self.plan_hits / self.plan_reads if self.plan_reads else 0.0


def _ts(value: Any) -> float:
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, datetime):
        return value.timestamp()
    return datetime.fromisoformat(str(value).replace("Z", "+00:00")).timestamp()


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        source: MemorySource,
        builder: BlockBuilder,
        count_tokens: Callable[[str], int],
        *,
        heat_path: str | Path | None = None,
        clock: Callable[[], float] = time.time,
        redis_url: str | None = None,
        queue: Any = None,
    ):
        self.config, self.source, self.builder, self.count_tokens, self.clock = (
            config,
            source,
            builder,
            count_tokens,
            clock,
        )
        self.policy = promotion_policy(config.promotion)
        self.heat = HeatTable(
            heat_path,
            half_life_s=config.half_life_s,
            use_weight=config.use_weight,
            recency_prior=config.recency_prior,
        )
        self.plans = PlanBook()
        self.queue = queue if queue is not None else make_queue(redis_url)
        self._lock = threading.Lock()  # generations, build bookkeeping
        self._generation: dict[str, int] = {}
        self._known: set[str] = set()
        self._deferred: set[str] = set()  # refreshes waiting for the builder to be ready
        self._latencies: deque[float] = deque(maxlen=1000)
        self._counts = {"reads": 0, "hits": 0, "tasks": 0, "builds": 0, "discarded": 0}
        self._distill: dict[str, list[str]] = {}
        self._in_task = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._unsubscribe: Callable[[], None] | None = None

    # -- lifecycle ----------------------------------------------------------------------------------------
    def start(self) -> None:
        self._unsubscribe = self.source.subscribe(self.on_change)
        self._thread = threading.Thread(target=self._loop, name="kvmem-scheduler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
        self.heat.close()

    # -- request path (never blocks) ------------------------------------------------------------------
    def get(self, user_id: str) -> Plan:
        plan = self.plans.get(user_id)
        self._counts["reads"] += 1
        if plan.block is not None:
            self._counts["hits"] += 1
        elif user_id not in self._known:
            self._known.add(user_id)
            self.queue.put(Task("refresh", user_id))
        return plan

    def record_access(self, event: AccessEvent) -> None:
        self.queue.put(Task("access", event.user_id, event))

    def session_start(self, user_id: str) -> None:
        """Next-scene prediction: a user opening a session will ask soon; make their block resident."""
        self.queue.put(Task("prewarm", user_id))

    # -- store changes (synchronous, cheap) ------------------------------------------------------------
    def on_change(self, event: Any) -> None:
        kind = {"add": "added", "update": "updated", "delete": "deleted"}.get(event.kind, event.kind)
        user_id, memory_id, now = event.user_id, event.memory_id, self.clock()
        dropped = None
        with self._lock:
            if kind == "added":
                self.heat.seen(user_id, memory_id, now)
            else:
                self._generation[user_id] = self._generation.get(user_id, 0) + 1
                if kind == "deleted":
                    self.heat.forget(user_id, memory_id)
                else:
                    self.heat.seen(user_id, memory_id, now)
                plan = self.plans.get(user_id)
                if plan.block is not None and memory_id in plan.block.memory_ids:
                    self.plans.publish(Plan(user_id, None, plan.adapter_id, plan.version + 1, now))
                    dropped = plan.block.item_id
        if dropped is not None:
            self.builder.drop_block(dropped)
            log.info("user %r: block %s stopped serving (memory %s %s)", user_id, dropped, memory_id, kind)
        self.queue.put(Task("refresh", user_id))

    # -- worker ----------------------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            task = self.queue.get(timeout_s=0.5)
            if task is None:
                self._retry_deferred()
                continue
            self.handle(task)

    def _retry_deferred(self) -> None:
        if self._deferred and self.builder.ready():
            users, self._deferred = sorted(self._deferred), set()
            for user in users:
                self.queue.put(Task("refresh", user))

    def run_pending(self) -> int:
        """Run every queued task now, in this thread (tests and offline use). Returns how many ran."""
        n = 0
        while (task := self.queue.get(timeout_s=0)) is not None:
            self.handle(task)
            n += 1
        return n

    def idle(self) -> bool:
        """No task queued or running, and no refresh waiting for the builder."""
        return not len(self.queue) and not self._in_task and not self._deferred

    def handle(self, task: Task) -> None:
        start = time.perf_counter()
        self._in_task = True
        try:
            if task.kind == "access":
                ev: AccessEvent = task.payload
                self.heat.record(ev.user_id, ev.retrieved_ids, ev.used_ids, ev.at)
                self.refresh(ev.user_id)
            elif task.kind == "refresh":
                self.refresh(task.user_id)
            elif task.kind == "prewarm":
                plan = self.refresh(task.user_id)
                warm = getattr(self.builder, "warm_block", None)
                if plan.block is not None and warm is not None:
                    warm(plan.block.item_id)
            elif task.kind == "evict":
                self.enforce_total_cap()
        except Exception:  # noqa: BLE001 - the worker must outlive any one task; logged with its traceback
            log.exception("scheduler task %s for %r failed", task.kind, task.user_id)
        finally:
            self.queue.ack(task)  # after the task ran (or failed for good): at-least-once with Redis
            self._in_task = False
            self._latencies.append(time.perf_counter() - start)
            self._counts["tasks"] += 1

    def _memories(self, user_id: str) -> list[Any]:
        out, page = [], 1
        while True:
            chunk = self.source.list(user_id, page=page, page_size=500)
            out.extend(chunk.items)
            if len(out) >= chunk.total or not chunk.items:
                return out
            page += 1

    def refresh(self, user_id: str) -> Plan:
        """Recompute the user's block; build it if it changed; publish unless a store change raced us."""
        if not self.builder.ready():
            self._deferred.add(user_id)
            return self.plans.get(user_id)
        with self._lock:
            generation = self._generation.get(user_id, 0)
        now = self.clock()
        memories = {m.id: m for m in self._memories(user_id)}
        stats = self.heat.stats(user_id)
        for mid, m in memories.items():
            if mid not in stats:
                self.heat.seen(user_id, mid, _ts(m.created_at))
        stats = self.heat.stats(user_id)
        candidates = [
            Candidate(
                mid, self.policy.score(stats[mid], now, self.config.half_life_s), self.count_tokens(m.text)
            )
            for mid, m in memories.items()
        ]
        current = self.plans.get(user_id)
        decision = choose_block(
            candidates,
            current.block.memory_ids if current.block else (),
            self.config.user_cap_tokens,
            self.config.hysteresis,
        )
        self._distill[user_id] = distill_candidates(
            stats, now, min_uses=self.config.distill_min_uses, min_stable_s=self.config.distill_min_stable_s
        )
        if decision.action == "keep":
            return current
        block = None
        if decision.memory_ids:
            texts = tuple(memories[m].text for m in decision.memory_ids)
            built = self.builder.build_block(user_id, texts, decision.memory_ids)
            self._counts["builds"] += 1
            block = BlockPlan(built.item_id, decision.memory_ids, texts, built.num_tokens, built.num_bytes)
        with self._lock:
            if self._generation.get(user_id, 0) != generation:
                self._counts["discarded"] += 1
                stale = block.item_id if block else None
                published = None
            else:
                latest = self.plans.get(user_id)
                published = Plan(user_id, block, latest.adapter_id, latest.version + 1, now)
                self.plans.publish(published)
                stale = (
                    latest.block.item_id
                    if latest.block and (not block or latest.block.item_id != block.item_id)
                    else None
                )
        if stale is not None:
            self.builder.drop_block(stale)
        if published is None:
            log.info("user %r: a store change raced the block build; rebuilding", user_id)
            self.queue.put(Task("refresh", user_id))
            return self.plans.get(user_id)
        log.info(
            "user %r: block %s (%d memories, %d tokens)",
            user_id,
            decision.action,
            len(decision.memory_ids),
            block.num_tokens if block else 0,
        )
        if self.config.total_block_bytes is not None:
            self.enforce_total_cap()
        return published

    def enforce_total_cap(self) -> list[str]:
        """Drop whole blocks (least heat per byte first) until every user's blocks fit the overall cap."""
        now = self.clock()
        usages = []
        for plan in self.plans.all():
            if plan.block is None:
                continue
            stats = self.heat.stats(plan.user_id)
            value = sum(
                self.policy.score(stats[m], now, self.config.half_life_s)
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

    def stats(self) -> SchedulerStats:
        blocks = [p.block for p in self.plans.all() if p.block is not None]
        lat = sorted(self._latencies)
        return SchedulerStats(
            num_blocks=len(blocks),
            block_tokens=sum(b.num_tokens for b in blocks),
            block_bytes=sum(b.num_bytes for b in blocks),
            plan_reads=self._counts["reads"],
            plan_hits=self._counts["hits"],
            queue_depth=len(self.queue),
            tasks_done=self._counts["tasks"],
            task_p50_s=lat[len(lat) // 2] if lat else 0.0,
            task_max_s=lat[-1] if lat else 0.0,
            builds=self._counts["builds"],
            discarded_builds=self._counts["discarded"],
            distill_candidates=sum(len(v) for v in self._distill.values()),
        )

    def distill_candidates(self, user_id: str) -> list[str]:
        return list(self._distill.get(user_id, []))
