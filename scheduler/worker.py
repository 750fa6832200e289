"""The worker: runs the scheduler's tasks (apply access, rebuild, prewarm, evict) and the synchronous invalidation.

Owns the per-user generation counter that makes a build racing a store change discard its result, the only
writes to heat and plans, and the refresh that chooses, builds and publishes a user's block. Mixed in: the
synchronous invalidation and the delete cascade beyond the current plan (invalidate.py) and the overall cap
(total_cap.py). Blocks are built through an injected `BlockMaker` (block_maker.py: serving's adapter over its
backend; a fake in tests and the simulator); what keeps published blocks servable is guard.py; the queue and
the thread that drains it belong to the facade in service.py.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol

from scheduler.block_maker import BlockMaker
from scheduler.config import SchedulerConfig
from scheduler.guard import BlockGuard, Fence
from scheduler.heat import AccessEvent, HeatTable
from scheduler.invalidate import Invalidation, memory_time
from scheduler.plan import AdapterPlan, BlockPlan, Plan, PlanBook
from scheduler.policy import (
    BlockDecision,
    Candidate,
    choose_block,
    distill_candidates,
    promotion_policy,
    user_cap_tokens,
)
from scheduler.queue import Task
from scheduler.total_cap import TotalCap

if TYPE_CHECKING:
    from kvmem.kv.blocks import BuiltBlock

log = logging.getLogger(__name__)

SNAPSHOT_USERS = 64  # users whose memory lists the refresh keeps (a list of 8,000 memories: a few MB)


class MemorySource(Protocol):  # kvmem.text.MemoryStore satisfies it
    def list(
        self, user_id: str, *, session_id: str | None = None, page: int = 1, page_size: int = 20
    ) -> Any: ...
    def subscribe(self, callback: Callable[[Any], None]) -> Callable[[], None]: ...


class TaskQueue(Protocol):  # scheduler.queue.InProcessQueue / RedisStreamsQueue
    def put(self, task: Task) -> None: ...
    def get(self, timeout_s: float | None = None) -> Task | None: ...
    def ack(self, task: Task) -> None: ...
    def __len__(self) -> int: ...


class Worker(Invalidation, TotalCap):
    """Every task is idempotent: a refresh recomputes the block from the store and heat, so running it twice
    (coalesced queue, Redis redelivery) publishes the same plan and builds nothing the second time."""

    def __init__(
        self,
        config: SchedulerConfig,
        source: MemorySource,
        builder: BlockMaker,
        count_tokens: Callable[[str], int],
        heat: HeatTable,
        plans: PlanBook,
        queue: TaskQueue,
        clock: Callable[[], float],
        fence: Fence | None = None,
        adapter_for: Callable[[str], AdapterPlan | None] | None = None,
    ):
        self.config, self.source, self.builder, self.count_tokens = config, source, builder, count_tokens
        self.fence = fence
        self.adapter_for = adapter_for  # the user's served LoRA adapter (the block is built under it)
        self.heat, self.plans, self.queue, self.clock = heat, plans, queue, clock
        self.policy = promotion_policy(config.promotion)
        self._lock = threading.Lock()  # generations and every plan publish
        self.guard = BlockGuard(self._lock, plans, queue, builder, fence, clock)
        plans.on_drop(self._forget_user_state)
        # store changes per user, counted only while a refresh of theirs is in flight (bounded by those)
        self._changes: dict[str, int] = {}
        self._in_flight: dict[str, int] = {}
        self.deferred: set[str] = set()  # refreshes waiting for the builder to be ready
        self.latencies_s: deque[float] = deque(maxlen=1000)
        self.counts = {"tasks": 0, "builds": 0, "prefills": 0, "discarded": 0, "cuts": 0}
        self._user_locks = tuple(threading.Lock() for _ in range(64))  # invalidate.py's per-user stripes
        self.distill: dict[str, list[str]] = {}
        self.in_task = False
        # user -> memory id -> (version, tokens), for the user's live memories as of their last refresh
        self._token_counts: dict[str, dict[str, tuple[int, int]]] = {}
        # user -> (store generation, their memories as read then): the refresh's incremental read, LRU-bounded
        self._snapshots: OrderedDict[str, tuple[int, list[Any]]] = OrderedDict()
        self.header_tokens = 0  # tokens every block carries besides its memories (learned, see refresh)
        self.bytes_per_token: float = config.bytes_per_token  # the config's guess until a block is built
        self._bytes_learned = False
        self.between_tasks: Callable[[], None] = lambda: None  # the facade's cheap checks (service.py)
        self.stopping = threading.Event()  # the facade's stop (service.py): a task failing then was cancelled

    def _forget_user_state(self, user_id: str) -> None:
        """Bounded with the plan book: a user whose plan it dropped loses the caches kept for them here (their
        token counts and distillation candidates are recomputed by the refresh their next read enqueues).
        The change counter stays while a refresh is in flight: that build must still see a store change."""
        self._token_counts.pop(user_id, None)
        self._snapshots.pop(user_id, None)
        self.distill.pop(user_id, None)
        self.guard.forget_user_state(user_id)

    # -- the thread's loop ---------------------------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                self._turn()
            except Exception:  # the thread outlives any one failure (a task's own are caught in handle)
                log.exception("scheduler: the worker's loop failed (a store or queue error?); it goes on")
                stop.wait(0.5)

    def _turn(self) -> None:
        """One turn of the loop: the facade's checks, then a task, or the deferred and fenced retries."""
        self.between_tasks()
        task = self.queue.get(timeout_s=0.5)
        if task is None:
            self.retry_deferred()
            if self.fence is not None:
                self.fence.retry_pending()
            return
        self.handle(task)

    def retry_deferred(self) -> None:
        if self.deferred and self.builder.ready():
            users, self.deferred = sorted(self.deferred), set()
            for user in users:
                self.queue.put(Task("refresh", user))

    def handle(self, task: Task) -> None:
        start = time.perf_counter()
        self.in_task = True
        try:
            if task.kind == "access":
                # one event (Redis) or a user's coalesced events (in process): all add heat, one refresh
                events = task.payload if isinstance(task.payload, (tuple, list)) else (task.payload,)
                for event in events:
                    if not self.apply_access(event):
                        log.debug("user %r: access event replayed; heat unchanged", event.user_id)
                if events:  # even on a replay: the first run may have died before its refresh
                    self.refresh(events[0].user_id)
            elif task.kind == "refresh":
                self.refresh(task.user_id)
            elif task.kind == "prewarm":
                plan = self.refresh(task.user_id)
                if plan.block is not None:
                    self.builder.warm_block(plan.block.item_id)
            elif task.kind == "evict":
                self.enforce_total_cap()
            else:
                log.error("unknown scheduler task kind %r; dropped", task.kind)
        except Exception as exc:  # noqa: BLE001 - the worker must outlive any one task; logged with its traceback
            if self.stopping.is_set():  # shutting down: its build was cancelled (Scheduler.stop)
                log.info("scheduler task %s for %r ended by the shutdown: %s", task.kind, task.user_id, exc)
            else:
                log.exception("scheduler task %s for %r failed", task.kind, task.user_id)
        finally:
            self.queue.ack(task)  # after the task ran (or failed for good): at-least-once with Redis
            self.in_task = False
            self.latencies_s.append(time.perf_counter() - start)
            self.counts["tasks"] += 1

    def apply_access(self, event: AccessEvent) -> bool:
        """Apply an access event's heat for the memories still live only: an event queued before a delete must
        not bring the deleted memory's heat row back. Liveness is read and the heat written under the lock the
        invalidation takes, so a delete either is seen by the read or forgets the row after. Returns False on a
        replay (HeatTable.apply)."""
        by_ids = getattr(self.source, "memories_by_ids", None)
        with self._lock:
            live = None
            if by_ids is not None:
                wanted = dict.fromkeys([*event.retrieved_ids, *event.used_ids])
                live = {m.id for m in by_ids(event.user_id, wanted, include_superseded=True)}
            return self.heat.apply(event, live=live)

    # -- rebuild -------------------------------------------------------------------------------------------
    def _memories(self, user_id: str) -> list[Any]:
        """The user's memories. Incremental where it can be: with a source that says the user's generation
        (kvmem's MemoryStore: it moves in the transaction of every change to what a memory says), the list
        read at a generation is reused while the generation is the same; an access-only refresh then reads one
        row instead of every memory (8,000 memories: see README). The generation is read first, so a change
        racing the list makes the next refresh read again. At most SNAPSHOT_USERS users' lists are kept."""
        generation = getattr(self.source, "generation", None)
        gen = generation(user_id) if generation is not None else None
        cached = self._snapshots.get(user_id)
        if gen is not None and cached is not None and cached[0] == gen:
            self._snapshots.move_to_end(user_id)
            return cached[1]
        out, page = [], 1
        while True:
            chunk = self.source.list(user_id, page=page, page_size=500)
            out.extend(chunk.items)
            if len(out) >= chunk.total or not chunk.items:
                break
            page += 1
        if gen is not None:
            self._snapshots[user_id] = (gen, out)
            self._snapshots.move_to_end(user_id)
            while len(self._snapshots) > SNAPSHOT_USERS:
                self._snapshots.popitem(last=False)
        return out

    def _memory_tokens(self, user_id: str, memories: Iterable[Any]) -> dict[str, int]:
        """Token count of each memory, counted once per (id, version): an access event refreshes the user's
        block while the next request's forward runs, and re-tokenizing every memory then held the GIL for
        ~40 ms at 500 memories. Keeps only the user's live memories."""
        known = self._token_counts.get(user_id, {})
        fresh = {}
        for m in memories:
            hit = known.get(m.id)
            fresh[m.id] = (
                hit if hit is not None and hit[0] == m.version else (m.version, self.count_tokens(m.text))
            )
        self._token_counts[user_id] = fresh
        return {mid: n for mid, (_, n) in fresh.items()}

    def _changed(self, user_id: str) -> None:
        """A store change for the user (under self._lock): a refresh in flight for them must not publish."""
        if user_id in self._in_flight:
            self._changes[user_id] = self._changes.get(user_id, 0) + 1

    def refresh(self, user_id: str, *, build: bool = True) -> Plan:
        """Recompute the user's block; build it if it changed; publish unless a store change raced us.
        `build=False` (a restore: scheduler.restore): publish the chosen block only if it is already stored
        (builder's `find_block`), else leave the plan as it is; nothing is prefilled."""
        if not self.builder.ready():
            if build:
                self.deferred.add(user_id)
            return self.plans.get(user_id)
        with self._lock:
            self._in_flight[user_id] = self._in_flight.get(user_id, 0) + 1
            generation = self._changes.get(user_id, 0)
        try:
            return self._refresh(user_id, generation, build)
        finally:
            with self._lock:
                self._in_flight[user_id] -= 1
                if not self._in_flight[user_id]:
                    del self._in_flight[user_id]
                    self._changes.pop(user_id, None)

    def _refresh(self, user_id: str, generation: int, build: bool) -> Plan:
        fenced = self.fence.read(user_id) if self.fence is not None else None  # before reading memories
        now = self.clock()
        memories = {m.id: m for m in self._memories(user_id)}
        stats = self.heat.stats(user_id)
        unseen = [(mid, memory_time(m.created_at)) for mid, m in memories.items() if mid not in stats]
        if unseen:  # one transaction; none when a change raced this read (a deleted memory's row stays gone)
            with self._lock:
                if self._changes.get(user_id, 0) == generation:
                    self._bookkeep(user_id, "first seen", self.heat.seen_many, user_id, unseen)
            stats = self.heat.stats(user_id)
        stats = {mid: stats.get(mid) or self._prior(m) for mid, m in memories.items()}
        counts = self._memory_tokens(user_id, memories.values())
        adapter = self.adapter_for(user_id) if self.adapter_for is not None else None
        under = self.block_adapter(adapter)
        held_by_adapter = set(adapter.memory_ids) if adapter is not None else set()  # not in the block
        candidates = [
            Candidate(
                mid,
                self.policy.score(stats[mid], now, self.config.half_life_s),
                counts[mid],
                stats[mid].last_change,
            )
            for mid in memories
            if mid not in held_by_adapter
        ]
        self.distill[user_id] = distill_candidates(
            stats, now, min_uses=self.config.distill_min_uses, min_stable_s=self.config.distill_min_stable_s
        )
        current = self.plans.get(user_id)
        # a block built under another adapter (or the base model) is not kept: its K/V are not this one's
        other_adapter = current.block is not None and current.block.adapter != under
        held = current.block.memory_ids if current.block and not other_adapter else ()
        if not build and (under is not None or other_adapter):
            return current  # a restore finds base-model blocks only; under an adapter it is built on demand
        if not held and under is None and not other_adapter:
            # no block here yet (a restore at start; or a user new to this process: a failover from a replica
            # that died, the plan book's eviction): held is the newest stored block the policy keeps as it is,
            # so it is found by its content address, not prefilled again (a built order depends on history)
            stored = self.builder.stored_memory_ids(user_id)
            cap, hysteresis = self._cap_tokens(), self.config.hysteresis
            held = next(
                (
                    ids
                    for ids in stored
                    if ids and choose_block(candidates, ids, cap, hysteresis).action == "keep"
                ),
                (),
            )
        tokens = {c.memory_id: c.num_tokens for c in candidates}
        block = None
        for attempt in range(2):
            decision = choose_block(candidates, held, self._cap_tokens(), self.config.hysteresis)
            if (
                decision.action == "keep"
                and not other_adapter
                and (current.block or (build and not decision.memory_ids))
            ):
                return current  # (a stored block kept goes on: it is found and published below)
            if not decision.memory_ids:
                break
            texts = tuple(memories[m].text for m in decision.memory_ids)  # fetched now, published with it
            if build:
                under_adapter = {"adapter_id": adapter.adapter_id} if under is not None else {}
                built = self.builder.build_block(user_id, texts, decision.memory_ids, **under_adapter)
                self.counts["builds"] += 1
                self.counts["prefills"] += bool(getattr(built, "built", True))  # fakes may not say
            elif (built := self.builder.find_block(user_id, texts, decision.memory_ids)) is None:
                return current
            block = BlockPlan.of(built, decision.memory_ids, texts, under)
            if self.config.user_block_bytes is None or built.num_bytes <= self.config.user_block_bytes:
                break
            # Over the byte cap: the block's header (system prompt) was not counted. Learn it, drop the item,
            # and choose again once with the cap the header leaves.
            self._learn_header(built, sum(tokens[m] for m in decision.memory_ids))
            log.info(
                "user %r: block of %d bytes over the per-user cap; header learned", user_id, built.num_bytes
            )
            if build and (not current.block or built.item_id != current.block.item_id):
                self.builder.drop_block(built.item_id)
            block = None
            if attempt == 1:
                decision = BlockDecision((), "drop", 0.0)
        with self._lock:
            if self._changes.get(user_id, 0) != generation:
                self.counts["discarded"] += 1
                serving = self.plans.get(user_id).block
                # content-addressed: the item may be the one published meanwhile (a change's cut), kept then
                stale = block.item_id if block and (not serving or serving.item_id != block.item_id) else None
                published = None
            else:
                if block is not None and not self.guard.stored(block.item_id):
                    # e.g. bigger than the store's disk budget: publish text, not a block that is gone
                    log.info("user %r: block %s left the store before publishing", user_id, block.item_id)
                    block = None
                latest = self.plans.get(user_id)
                published = Plan(user_id, block, latest.adapter_id, latest.version + 1, now)
                self.plans.publish(published)
                if block is not None:
                    self.guard.stamp(user_id, block.item_id, fenced)
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

    def block_adapter(self, adapter: AdapterPlan | None) -> str | None:
        """The adapter a user's block is built under: their served adapter's name, if the builder can build
        under it (the transformers backend); else None: a base-model block, which serving then sends as text
        under the adapter (vLLM: its prefix cache, kept per adapter name, reuses what it computed)."""
        if adapter is None or not self.builder.builds_under_adapter:
            return None
        return adapter.name

    def _cap_tokens(self) -> int:
        if not self._bytes_learned and self.config.user_block_bytes is not None:
            if value := self.builder.kv_bytes_per_token():  # the loaded model's, exact
                self.bytes_per_token, self._bytes_learned = float(value), True
        return user_cap_tokens(
            self.config.user_block_tokens,
            self.config.user_block_bytes,
            self.bytes_per_token,
            self.header_tokens,
        )

    def _learn_header(self, built: BuiltBlock, memory_tokens: int) -> None:
        own = built.num_tokens - getattr(built, "shared_tokens", 0)  # num_bytes: the block's own tokens'
        if own > 0:  # the first block replaces the config's guess (another model's); later ones only raise it
            learned = built.num_bytes / own
            self.bytes_per_token = max(self.bytes_per_token, learned) if self._bytes_learned else learned
            self._bytes_learned = True
        self.header_tokens = max(self.header_tokens, own - memory_tokens)
