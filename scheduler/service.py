"""The Scheduler facade: heat + plans + a queue + the worker thread that drains it.

Request path: `get` (a dict read, plus a check that the block is still stored and, with replicas, not fenced
off; a user's first read in this process also looks for their stored block, which never prefills) and
`record_access` / `session_start` / `report_unservable` (an enqueue). Store changes arrive through
`on_change`, which stops serving every affected block *before it returns* (worker.invalidate) and enqueues
the rebuild. Composes the parts; computes nothing itself. The served adapter's view and poll are mixed in
(served_adapters.py); the stats record is stats.py's. Knows nothing of HTTP.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from scheduler.block_maker import BlockMaker
from scheduler.config import SchedulerConfig
from scheduler.guard import Fence
from scheduler.heat import AccessEvent, HeatTable
from scheduler.invalidate import both_halves
from scheduler.plan import Plan, PlanBook
from scheduler.queue import Task, make_queue
from scheduler.served_adapters import ServedAdapters
from scheduler.stats import SchedulerStats
from scheduler.worker import MemorySource, TaskQueue, Worker

log = logging.getLogger(__name__)

LAYOUT_POLL_S = (
    1.0  # how often the worker asks whether the builder's layout changed (a stat, when it did not)
)
RESTORE_WAIT_S = 2.0  # how long a read waits for the same user's first-read restore under way elsewhere


class Scheduler(ServedAdapters):
    def __init__(
        self,
        config: SchedulerConfig,
        source: MemorySource,
        builder: BlockMaker,
        count_tokens: Callable[[str], int],
        *,
        heat_path: str | Path | None = None,
        clock: Callable[[], float] = time.time,
        redis_url: str | None = None,
        redis_stream: str = "kvmem:scheduler",
        queue: TaskQueue | None = None,
        fence: Fence | None = None,
        adapters: Any = None,
        heat_read_only: bool = False,
    ):
        self.config, self.source, self.builder, self.clock = config, source, builder, clock
        shared = getattr(source, "database_url", None)  # a PostgreSQL store: replicas share heat there too
        self.heat = HeatTable(
            shared if isinstance(shared, str) and heat_path is not None else heat_path,
            half_life_s=config.half_life_s,
            use_weight=config.use_weight,
            recency_prior=config.recency_prior,
            read_only=heat_read_only,
        )
        self.plans = PlanBook(config.max_plans)
        self.queue: TaskQueue = (
            queue
            if queue is not None
            else make_queue(redis_url, max_tasks=config.max_queued_tasks, stream=redis_stream)
        )
        if fence is None and redis_url:  # replicas share Redis: invalidation must reach them all (README)
            from scheduler.fence import RedisFence

            fence = RedisFence(redis_url)
        self.fence = fence
        self.adapters = adapters  # kvmem.adapters.ActiveAdapters, or None: no parametric tier
        # called with the user id when a store change stopped their adapter (serving's background distillation
        # queues a new version); on the store's thread, before its call returns: they must only enqueue
        self.adapter_stopped: list[Callable[[str], None]] = []
        self.worker = Worker(
            config,
            source,
            builder,
            count_tokens,
            self.heat,
            self.plans,
            self.queue,
            clock,
            fence,
            adapter_for=self._worker_adapter if adapters is not None else None,
        )
        self._reads = self._hits = 0  # request-path counters: plain ints, no lock (a lost increment is fine)
        # users whose first-read restore is under way: a concurrent read of the same user waits for it
        self._restoring: dict[str, threading.Event] = {}
        self._restoring_lock = threading.Lock()
        self._stop = threading.Event()
        self.worker.stopping = self._stop
        self._thread: threading.Thread | None = None
        self._unsubscribe: Callable[[], None] | None = None
        self._unsubscribe_drops: Callable[[], None] | None = None
        # the builder's layout (e.g. the deployment's shared knowledge): a change retracts every block
        self._layout_seen = 0  # builders start at generation 0
        self._layout_polled = float("-inf")
        self._adapters_polled = float("-inf")
        self.worker.between_tasks = self._between_tasks

    # -- lifecycle ----------------------------------------------------------------------------------------
    def start(self, *, thread: bool = True) -> None:
        """Subscribe to the store's changes and start the worker thread. With `thread=False` tasks run only in
        `run_pending`/`flush`, in the caller's thread: tests and the simulator drive the same worker that way."""
        self._unsubscribe = self.source.subscribe(self.on_change)
        self._unsubscribe_drops = self.builder.subscribe_dropped(self.worker.guard.on_dropped)
        if thread:
            self._thread = threading.Thread(
                target=self.worker.run, args=(self._stop,), name="kvmem-scheduler", daemon=True
            )
            self._thread.start()

    def stop(self) -> None:
        """Stop the worker: a block build under way is cancelled, not waited for (a restart rebuilds what it
        needs), and the thread is joined."""
        self._stop.set()
        self.builder.cancel_builds()
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        if self._unsubscribe_drops is not None:
            self._unsubscribe_drops()
            self._unsubscribe_drops = None
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
        for part in (self.queue, self.fence):
            close = getattr(part, "close", None)
            if close is not None:
                close()
        self.heat.close()

    # -- request path (never waits on the worker) ----------------------------------------------------------
    def check_fence(self) -> None:
        """Raises kvmem.errors.DependencyUnavailable when replicas share a fence and it cannot be written now:
        serving refuses a change or a delete then (503) rather than commit one peers would not hear of."""
        if self.fence is not None:
            self.fence.ping()

    def get(self, user_id: str) -> Plan:
        """The user's current plan. A user the plan book does not hold (never seen, or dropped past
        `config.max_plans`) first gets their stored block if one is there (`_restore_first_read`: a returning
        user, a user moved here from a replica that died), else an empty plan; either way their plan is
        enqueued once (built when nothing stored fits). The book is also the bounded record of which users were
        already asked for."""
        if user_id not in self.plans or user_id in self._restoring:
            self._first_read(user_id)
        checked, plan = self._with_adapter(self.plans.get(user_id))
        if not checked:  # the worker checks the moved pointer, then refreshes
            self.queue.put(Task("refresh", user_id))
        if plan.block is not None and (
            plan.block.adapter != self.worker.block_adapter(plan.adapter)
            or (plan.adapter is not None and set(plan.adapter.memory_ids) & set(plan.block.memory_ids))
        ):
            # built under another adapter version (or the base model): its K/V are not what this request
            # computes; or it holds facts the adapter now holds. The refresh builds the block under the served
            # adapter, without its facts (coalesced in process)
            plan = replace(plan, block=None)
            self.queue.put(Task("refresh", user_id))
        # no store check here (the store reports its drops; a block gone behind its back falls back to prefill
        # and is reported): only the fence, with replicas (README: why that read stays)
        why = self.worker.guard.unservable_reason(plan, check_store=False) if plan.block is not None else None
        if why is not None:
            plan = self._without_block(plan, why)
        self._reads += 1
        if plan.block is not None:
            self._hits += 1
        elif user_id in self.worker.guard.evicted:  # its block was evicted: rebuild now that it is asked for
            self.worker.guard.evicted.discard(user_id)
            self.queue.put(Task("refresh", user_id))
        elif self.plans.register(user_id):
            self.queue.put(Task("refresh", user_id))
        return plan

    def _first_read(self, user_id: str) -> None:
        """A user the plan book does not hold: the first reader registers them and restores their stored
        block (then queues their refresh); a reader arriving meanwhile (a second request of the user, as after
        a failover) waits for that restore, at most RESTORE_WAIT_S, instead of being served text."""
        with self._restoring_lock:
            pending = self._restoring.get(user_id)
            first = pending is None and self.plans.register(user_id)
            if first:
                pending = self._restoring[user_id] = threading.Event()
        if not first:
            if pending is not None:
                pending.wait(RESTORE_WAIT_S)
            return
        try:
            self._restore_first_read(user_id)  # a user new to this process: their stored block, if any
        finally:
            with self._restoring_lock:
                self._restoring.pop(user_id, None)
            pending.set()
        self.queue.put(Task("refresh", user_id))

    def _restore_first_read(self, user_id: str) -> None:
        """Publish the user's stored block (built before a restart, by `kvmem build`, or by a replica that died
        and whose users the router moved here) before their first request is served, so it is served from KV,
        not as text: a restore (`Worker.refresh(build=False)`) finds a stored block by its content address and
        never prefills (store and file reads only: milliseconds; `get` runs on a request thread, never on the
        event loop). Anything else goes to the queued refresh, as before."""
        if not self.builder.finds_stored_blocks or not self.builder.ready():
            return
        log = logging.getLogger(__name__)
        started = time.perf_counter()
        try:
            block = self.worker.refresh(user_id, build=False).block
        except Exception:  # noqa: BLE001 - the queued refresh retries; the request is served as text
            log.warning("restoring the plan of %r on its first read failed", user_id, exc_info=True)
            return
        took_ms = (time.perf_counter() - started) * 1000
        if block is not None:
            log.info(
                "user %r: stored block %s restored on the first read (%.0f ms)",
                user_id,
                block.item_id,
                took_ms,
            )
        else:
            log.info("user %r: no stored block to restore on the first read (%.0f ms)", user_id, took_ms)

    def peek(self, user_id: str) -> Plan:
        """The user's plan as `get` would serve it, for reads that only look (the plan route, a search's tier
        labels): it never enqueues a refresh, never registers the user and never retracts a block for a
        rebuild, so reading a plan or searching cannot start a build. A block that `get` would not serve is left
        out here too. Unlike `get` it checks now (not the chat path: a stat, a moved adapter pointer's check,
        the block store's `has_block`), so what it reports is true when it answers."""
        adapter = self.served_adapter(user_id)  # fresh: the check the worker would make
        plan = self.plans.get(user_id)
        plan = replace(plan, adapter=adapter, adapter_id=adapter.adapter_id if adapter else None)
        if plan.block is None:
            return plan
        if plan.block.adapter != self.worker.block_adapter(plan.adapter) or (
            plan.adapter is not None and set(plan.adapter.memory_ids) & set(plan.block.memory_ids)
        ):
            return replace(plan, block=None)
        why = self.worker.guard.unservable_reason(plan)
        if why is not None and why != "fence_unreadable":  # lasting: retracted, rebuilt at the next `get`
            self.worker.guard.withdraw(user_id, plan.block.item_id, why, rebuild=False)
        return plan if why is None else replace(plan, block=None)

    def _without_block(self, plan: Plan, why: str) -> Plan:
        """The plan to serve instead of one whose block must not be served."""
        if why != "fence_unreadable":  # lasting: retracted for every reader (a stale one deleted), rebuilt
            self.worker.guard.withdraw(plan.user_id, plan.block.item_id, why)
        return replace(plan, block=None)

    def report_unservable(self, user_id: str, item_id: str) -> bool:
        """A request meant to serve `item_id` fell back to prefill: if it is still the user's block, the plan
        loses it, the item is dropped and a rebuild enqueued. Idempotent and cheap (a dict read when stale)."""
        return self.worker.guard.report_unservable(user_id, item_id)

    def forget_user(self, user_id: str) -> list[str]:
        """A user's memories were all deleted: every stored block of theirs stops being served and is
        deleted before this returns (the memory events already covered blocks naming live memory ids; this
        also catches blocks built from raw texts). Returns the forgotten item ids."""
        adapters = self.adapters

        def adapter_half() -> None:
            adapters.drop_covering(user_id, None, "all the user's memories were deleted")
            adapters.erase_stale(user_id, None, "all the user's memories were deleted")

        # every block of the user's, under an adapter or not
        return both_halves(
            adapter_half if adapters is not None else None, lambda: self.worker.forget_user(user_id)
        )

    def record_access(self, event: AccessEvent) -> None:
        self.queue.put(Task("access", event.user_id, event))

    def session_start(self, user_id: str) -> None:
        """Next-scene prediction: a user opening a session will ask soon; make their block resident."""
        self.queue.put(Task("prewarm", user_id))

    # -- store changes (synchronous, cheap) ----------------------------------------------------------------
    def on_change(self, event: Any) -> None:
        if event.kind == "updated" and not getattr(event, "text_changed", True):
            return  # tags or metadata only: the block's text and the adapter's facts are what they were
        batch = tuple(getattr(event, "batch", ()))
        if batch and event.memory_id != batch[0]:
            return  # one transaction deleted several memories: the first event ran the cascade for them all
        ids = list(batch or (event.memory_id,))
        adapters = self.adapters

        def adapter_half() -> None:  # before the store call returns
            why = (
                f"memory {event.memory_id} {event.kind}" if len(ids) == 1 else f"{len(ids)} memories deleted"
            )
            if adapters.drop_covering(event.user_id, ids, why):
                self._drop_adapter_block(event.user_id)
                for listener in list(self.adapter_stopped):
                    listener(event.user_id)
            # no version that holds it stays on disk (a rollback could serve it) and no block built under one
            erased = adapters.erase_stale(event.user_id, ids, why)
            self.worker.forget_adapters(event.user_id, [m.name for m in erased])

        try:  # the KV half raises FenceUnavailable when replicas could not be told
            both_halves(
                adapter_half if adapters is not None and event.kind != "added" else None,
                lambda: self.worker.invalidate(event),
            )
        finally:
            self.queue.put(Task("refresh", event.user_id))

    # -- the worker's cheap checks between tasks ------------------------------------------------------------
    def _between_tasks(self) -> None:
        self.poll_layout()
        self.poll_adapters()

    # -- the builder's layout (worker thread, between tasks) -------------------------------------------------
    def poll_layout(self, *, force: bool = False) -> bool:
        """At most every `LAYOUT_POLL_S` (unless `force`): ask the builder for its layout generation (it
        notices a changed knowledge install with a stat and switches its layout itself); on a change, retract
        every published block (all were laid out under the old layout: plans serve text, laid out under the new
        one, until rebuilt), discard refreshes in flight and enqueue every retracted user's rebuild. Returns
        whether the layout changed."""
        now = time.monotonic()
        if not force and now - self._layout_polled < LAYOUT_POLL_S:
            return False
        self._layout_polled = now
        try:
            generation = self.builder.layout_generation()
        except Exception:  # noqa: BLE001 - a failed check must not stop the worker; logged, retried
            logging.getLogger(__name__).exception("checking the builder's layout failed")
            return False
        if generation == self._layout_seen:
            return False
        self._layout_seen = generation
        worker, stamp = self.worker, self.clock()
        with worker._lock:
            users = [p.user_id for p in self.plans.all() if p.block is not None]
            for user_id in {*users, *worker._in_flight}:
                worker._changed(user_id)  # a build under the old layout must not publish
            for user_id in users:
                plan = self.plans.get(user_id)
                self.plans.publish(Plan(user_id, None, plan.adapter_id, plan.version + 1, stamp))
                worker.guard.forget_stamp(user_id)
        for user_id in users:
            self.queue.put(Task("refresh", user_id))
        logging.getLogger(__name__).info("layout changed: %d block(s) retracted, rebuilding", len(users))
        return True

    # -- offline use and tests -----------------------------------------------------------------------------
    def run_pending(self) -> int:
        """Run every queued task now, in this thread (tests and offline use), refreshes deferred until the
        builder was ready included. Returns how many ran."""
        self.poll_layout(force=True)
        self.poll_adapters(force=True)
        self.worker.retry_deferred()
        n = 0
        while (task := self.queue.get(timeout_s=0)) is not None:
            self.worker.handle(task)
            n += 1
        return n

    def flush(self, timeout_s: float = 60.0) -> None:
        """Every task queued so far has run: in this thread when no worker thread was started (`run_pending`),
        else once the worker is idle (polled; TimeoutError after `timeout_s`)."""
        if self._thread is None:
            self.run_pending()
            return
        self.poll_adapters(force=True)  # a pointer moved behind our back is seen now, not at the next poll
        deadline = time.monotonic() + timeout_s
        while not self.idle():
            if time.monotonic() > deadline:
                raise TimeoutError(f"the scheduler was still busy after {timeout_s} s")
            time.sleep(0.01)

    def idle(self) -> bool:
        """No task queued or running, and no refresh waiting for the builder."""
        return not len(self.queue) and not self.worker.in_task and not self.worker.deferred

    def restore(self, users: list[str] | None = None) -> int:
        """Restore plans at start (DESIGN: plans survive restarts): publish, for each user, the block the
        policy chooses from the store and the persisted heat if that block is already stored and valid (built
        before a restart or by `kvmem build`); nothing is prefilled, users without one get theirs on demand as
        before. `users` default: the source's users (`count_by_user`) or the heat table's, the most recently
        active first, at most `config.max_plans`. Call once the builder is ready. Returns plans restored."""
        if not self.builder.finds_stored_blocks or not self.builder.ready():
            return 0
        if users is None:
            by_count = getattr(self.source, "count_by_user", None)
            users = sorted(set(by_count()) if by_count is not None else set(self.heat.users()))
            users = sorted(users, key=self._last_active, reverse=True)[: self.config.max_plans]
        restored = 0
        for user_id in reversed(users):  # the most recently active last: the plan book keeps them longest
            if user_id in self.plans and self.plans.get(user_id).block is not None:
                continue
            try:
                restored += self.worker.refresh(user_id, build=False).block is not None
            except Exception:  # noqa: BLE001 - one bad user must not stop the others; traffic rebuilds it
                logging.getLogger(__name__).exception("restoring the plan of user %r failed", user_id)
        return restored

    def _last_active(self, user_id: str) -> float:
        stats = self.heat.stats(user_id).values()
        return max((s.last_access or s.first_seen for s in stats), default=0.0)

    def enforce_total_cap(self) -> list[str]:
        return self.worker.enforce_total_cap()

    def distill_candidates(self, user_id: str) -> list[str]:
        return list(self.worker.distill.get(user_id, []))

    def stats(self) -> SchedulerStats:
        blocks = [p.block for p in self.plans.all() if p.block is not None]
        lat = sorted(self.worker.latencies_s)
        counts = self.worker.counts
        return SchedulerStats(
            num_blocks=len(blocks),
            block_memories=sum(len(b.memory_ids) for b in blocks),
            block_tokens=sum(b.num_tokens for b in blocks),
            block_bytes=sum(b.num_bytes for b in blocks),
            tracked_memories=self.heat.num_tracked(),
            plan_reads=self._reads,
            plan_hits=self._hits,
            queue_depth=len(self.queue),
            tasks_done=counts["tasks"],
            task_p50_s=lat[len(lat) // 2] if lat else 0.0,
            task_p99_s=lat[min(len(lat) - 1, (len(lat) * 99) // 100)] if lat else 0.0,
            task_max_s=lat[-1] if lat else 0.0,
            builds=counts["builds"],
            prefills=counts["prefills"],
            discarded_builds=counts["discarded"],
            distill_candidates=sum(len(v) for v in self.worker.distill.values()),
            dropped_tasks=int(getattr(self.queue, "dropped", 0)),
            cuts=counts["cuts"],
        )


__all__ = ["AccessEvent", "Scheduler", "SchedulerStats"]
