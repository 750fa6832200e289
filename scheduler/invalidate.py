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
import zlib
from collections.abc import Callable, Sequence
from dataclasses import replace
from datetime import datetime
from typing import Any, TypeVar

from kvmem.errors import DependencyUnavailable
from scheduler.block_maker import BlockMaker
from scheduler.guard import BlockGuard, Fence
from scheduler.heat import HeatStats, HeatTable
from scheduler.plan import BlockPlan, Plan, PlanBook

log = logging.getLogger("scheduler.worker")  # the worker's log, as before this part moved here

T = TypeVar("T")

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
    _user_locks: tuple[threading.Lock, ...]  # stripes: a user's lock is _user_lock(user_id)
    counts: dict[str, int]

    # -- invalidation (synchronous, on the store's thread) -------------------------------------------------
    def invalidate(self, event: Any) -> str | None:
        """Apply a store ChangeEvent (or its whole `batch`: every memory one transaction deleted, in one
        cascade). In this order, before returning: if a changed memory is in the user's block, publish a
        block-less plan, cut the block before its first changed memory (the builder's `cut_block`: the
        memories before it keep their K/V, stored as a block of their own with no prefill) and drop the
        item; run the cascade (every stored block built from them); publish the cut; then the heat
        bookkeeping, which is logged and never raised when it fails (a heat store that cannot be written must
        not fail the store call or keep a deleted memory servable). Returns the dropped item id. The caller
        enqueues the rebuild, which then prefills only what follows the cut. Raises FenceUnavailable (the
        cascade's)."""
        kind = _CHANGE_KINDS.get(event.kind, event.kind)
        user_id, now = event.user_id, self.clock()
        ids = tuple(getattr(event, "batch", ()) or (event.memory_id,))
        if kind == "added":
            with self._lock:
                self._bookkeep(user_id, kind, self.heat.seen_many, user_id, [(m, now) for m in ids])
            return None
        with self._user_lock(user_id):  # one user's changes cut and cascade one at a time
            return self._invalidate(user_id, kind, ids, now)

    def _user_lock(self, user_id: str) -> threading.Lock:
        """The lock of the user's stripe: a cut is stored before the cascade runs and published after it, so
        another change of the same user (which could delete a memory the cut holds) waits for both."""
        return self._user_locks[zlib.crc32(user_id.encode()) % len(self._user_locks)]

    def _invalidate(self, user_id: str, kind: str, ids: tuple[str, ...], now: float) -> str | None:
        dropped, cut, published = None, None, None
        with self._lock:
            self._changed(user_id)
            plan = self.plans.get(user_id)
            block = plan.block
            if block is not None and not set(ids).isdisjoint(block.memory_ids):
                published = Plan(user_id, None, plan.adapter_id, plan.version + 1, now)
                self.plans.publish(published)
                dropped, stamp = block.item_id, self.guard.stamp_of(user_id)
                if stamp is not None and stamp[0] != block.item_id:
                    stamp = None  # not the fence read of this block's memories: no cut served with a fence
        if dropped is not None:
            kept = next(i for i, m in enumerate(block.memory_ids) if m in ids)
            cut = self._cut(user_id, block, kept) if kept else None
            self.builder.drop_block(dropped)
            log.info("user %r: block %s stopped serving (%d memories %s)", user_id, dropped, len(ids), kind)
        try:
            try:
                bumped = self._cascade_fenced(user_id, list(ids))[1]
            except BaseException:
                if cut is not None:  # never served: it may hold what another replica's cascade missed
                    self.builder.drop_block(cut.item_id)
                raise
            if cut is not None:
                self._publish_cut(user_id, published, cut, stamp, bumped)
        finally:
            with (
                self._lock
            ):  # under the lock: an access event is applied against the heat as it is after this
                if kind == "deleted":
                    self._bookkeep(user_id, kind, self.heat.forget_many, user_id, ids)
                else:
                    self._bookkeep(user_id, kind, self.heat.seen_many, user_id, [(m, now) for m in ids])
        return dropped

    def _cut(self, user_id: str, block: BlockPlan, kept: int) -> BlockPlan | None:
        """The block of `block`'s first `kept` memories, cut from its K/V (None: the builder cannot, or the
        cut failed: the rebuild prefills it all, as before cuts, and the failure is logged)."""
        try:
            built = self.builder.cut_block(block.item_id, block.memory_ids[:kept], block.texts[:kept])
        except Exception:  # noqa: BLE001 - a cut saves a prefill; failing one must not fail the store call
            log.exception("user %r: cutting block %s failed; it is rebuilt in full", user_id, block.item_id)
            return None
        if built is None:
            return None
        return BlockPlan.of(built, block.memory_ids[:kept], block.texts[:kept], block.adapter)

    def _publish_cut(
        self,
        user_id: str,
        blockless: Plan,
        cut: BlockPlan,
        stamp: tuple[str, int | None] | None,
        bumped: int | None,
    ) -> None:
        """Serve the cut until the rebuild replaces it: only while the block-less plan is still the user's (no
        refresh published since) and, with replicas, while the fence moved by this change alone since the cut
        block's memories were read (else no replica's change is missed: the cut is dropped, the rebuild
        prefills). The stamp is the fence after this change's bump."""
        with self._lock:
            current = self.plans.get(user_id)
            fence_ok = self.fence is None or (
                stamp is not None and stamp[1] is not None and bumped == stamp[1] + 1
            )
            serve = current.version == blockless.version and current.block is None and fence_ok
            # content-addressed: a refresh may have published the same item meanwhile; it stays then
            keep = serve or (current.block is not None and current.block.item_id == cut.item_id)
            if serve:
                self.plans.publish(
                    replace(current, block=cut, version=current.version + 1, updated_at=self.clock())
                )
                self.guard.stamp(user_id, cut.item_id, bumped)
                self.counts["cuts"] += 1
        if serve:
            log.info(
                "user %r: block cut to %d memories (%d tokens), no prefill",
                user_id,
                len(cut.memory_ids),
                cut.num_tokens,
            )
        elif not keep:
            self.builder.drop_block(cut.item_id)

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
        with self._user_lock(user_id):
            return self._forget_user(user_id)

    def _forget_user(self, user_id: str) -> list[str]:
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
        return self._cascade_fenced(user_id, memory_ids)[0]

    def _cascade_fenced(self, user_id: str, memory_ids: list[str] | None) -> tuple[list[str], int | None]:
        """`_cascade`, and the fence's value after its bump (None: no fence)."""
        forgotten = self.builder.forget(user_id, memory_ids)
        if forgotten:
            log.info("user %r: %d stored block(s) forgotten: %s", user_id, len(forgotten), forgotten)
        return forgotten, (self.fence.bump(user_id) if self.fence is not None else None)

    def forget_adapters(self, user_id: str, names: Sequence[str]) -> list[str]:
        """The cascade for adapter versions erased from disk: every stored block built under one of them (their
        K/V carry its facts) is deleted before this returns, and the fence moves. Raises FenceUnavailable."""
        with self._user_lock(user_id):
            return self._forget_adapters(user_id, names)

    def _forget_adapters(self, user_id: str, names: Sequence[str]) -> list[str]:
        forgotten = self.builder.forget_adapters(user_id, list(names)) if names else []
        if forgotten:
            log.info(
                "user %r: %d block(s) under erased adapters forgotten: %s", user_id, len(forgotten), forgotten
            )
            if self.fence is not None:
                self.fence.bump(user_id)
        return forgotten


def both_halves(adapter_half: Callable[[], None] | None, kv_half: Callable[[], T]) -> T:
    """A cascade's two halves: the adapter's, then the KV blocks'. The KV half runs even when the adapter half
    fails (a full disk under the registry left a deleted memory served from KV); the adapter half's failure is
    raised after it, the KV half's own failure first (the adapter's logged beside it)."""
    failure = None
    if adapter_half is not None:
        try:
            adapter_half()
        except Exception as exc:  # noqa: BLE001 - raised below, once the KV half has run
            failure = exc
    try:
        result = kv_half()
    except Exception:
        if failure is not None:
            log.error("the adapter half of a cascade failed too", exc_info=failure)
        raise
    if failure is not None:
        raise failure
    return result
