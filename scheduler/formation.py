"""Memory formation in the background: a user's pending log turns -> atomic memories, deduplicated and
superseding what they contradict, never on the request path (DESIGN invariant 8).

Owns the queue of users with pending turns (bounded, coalesced per user), the thread that drains it, retries
with backoff and the dead-letter rule. The turns themselves wait in the store's conversation log (state
'pending'), so nothing is lost when the queue is full or the process stops: a full queue refuses the user,
counts it (`overflowed`), and the next rescan of the log (every `rescan_interval_s`, and at start) picks the
user up. What a turn says is the extractor's business (kvmem.formation); what a new fact does to old ones is
consolidation's (kvmem.formation.consolidate); the store commits both in one transaction. Knows nothing of
HTTP.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvmem.formation.base import Extractor
from kvmem.formation.consolidate import DEFAULT_CLEARS, ExistingMemory, batch_ref, consolidate_batch
from kvmem.formation.errors import ExtractionError
from kvmem.formation.types import Fact, TurnInput

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FormationConfig:
    """Bounds and retry rule of the formation worker.

    A batch that fails with a transient error is retried after `retry_backoff_s * 2**(attempts-1)` seconds, up
    to `max_attempts` attempts in all; a permanent error, or the last attempt, dead-letters its turns with the
    reason (`GET /v1/memories/formation`, `/health`, `/metrics`); `requeue_dead` puts them back.
    """

    max_queued_users: int = 10_000
    batch_turns: int = 32  # turns handed to the extractor at once (one user's, oldest first)
    max_attempts: int = 3
    retry_backoff_s: float = 2.0
    rescan_interval_s: float = 30.0
    num_dense_candidates: int = 5  # nearest served memories checked as near-duplicates of each new fact

    def __post_init__(self) -> None:
        for name in ("max_queued_users", "batch_turns", "max_attempts", "num_dense_candidates"):
            if getattr(self, name) < 1:
                raise ValueError(f"FormationConfig.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("retry_backoff_s", "rescan_interval_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"FormationConfig.{name} must be > 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class PassResult:
    """What one pass over a user's pending turns did."""

    num_turns: int  # turns read
    num_added: int
    num_duplicates: int
    num_superseded: int
    num_dropped: int  # facts whose turns were deleted while they were formed
    error: str | None = None  # the extractor's failure (the turns stay pending or were dead-lettered)
    dead: bool = False


@dataclass
class FormationStats:
    """Counters since start (the store holds the durable pending / dead counts)."""

    queued_users: int = 0
    formed_turns_total: int = 0
    memories_added_total: int = 0
    superseded_total: int = 0
    duplicates_total: int = 0
    failures_total: int = 0
    dead_lettered_total: int = 0
    overflowed_total: int = 0
    last_error: str | None = None
    extractor: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def slots_touched(fact: Fact) -> tuple[str, ...]:
    """The slots a fact may supersede: its own, and those its value clears (consolidate.DEFAULT_CLEARS; a
    name ending in '|' is a prefix: every slot of that subject)."""
    if not fact.slot:
        return ()
    cleared = [c for r in DEFAULT_CLEARS if r.slot == fact.slot and fact.value in r.values for c in r.clears]
    return (fact.slot, *cleared)


def as_sentence(text: str) -> str:
    """A memory's text as a sentence: extractors return clauses ("I live in Lisbon"); a memory line reads
    better, and tokenizes like the memories users add, with its full stop."""
    text = text.strip()
    return text if not text or text[-1] in ".!?" else text + "."


def to_input(turn: Any) -> TurnInput:
    """A store Turn as the extractor reads it."""
    return TurnInput(
        id=turn.id,
        role=turn.role or "user",
        text=turn.text,
        chat_time=turn.chat_time,
        session_id=turn.session_id,
        speaker=turn.speaker,
    )


class FormationWorker:
    """One thread forming memories for the users queued with `submit`. Thread-safe."""

    def __init__(
        self,
        store: Any,
        extractor: Extractor,
        config: FormationConfig | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store, self.extractor = store, extractor
        self.config = config or FormationConfig()
        self.clock = clock
        self._queue: OrderedDict[str, float] = OrderedDict()  # user -> not before (clock), oldest first
        self._cond = threading.Condition()
        self._busy: str | None = None  # the user being formed now
        self._stop = False
        self._thread: threading.Thread | None = None
        self._next_rescan = 0.0
        self.stats = FormationStats(extractor=extractor.name)

    # -- queue ------------------------------------------------------------------------------------------------
    def submit(self, user_id: str, *, not_before: float | None = None) -> bool:
        """Queue the user's pending turns (coalesced: a queued user is queued once). False when the queue is
        full: the turns stay pending in the log and the next rescan queues the user."""
        with self._cond:
            if user_id in self._queue:
                if not_before is None:
                    self._queue[user_id] = min(self._queue[user_id], self.clock())
                self._cond.notify()
                return True
            if len(self._queue) >= self.config.max_queued_users:
                self.stats.overflowed_total += 1
                return False
            self._queue[user_id] = self.clock() if not_before is None else not_before
            self.stats.queued_users = len(self._queue)
            self._cond.notify()
            return True

    def forget(self, user_id: str) -> None:
        """Drop the user from the queue (their turns were deleted)."""
        with self._cond:
            self._queue.pop(user_id, None)
            self.stats.queued_users = len(self._queue)

    def rescan(self) -> int:
        """Queue every user the log holds pending turns for; returns how many were queued."""
        users = self.store.users_with_pending_turns()
        return sum(self.submit(u) for u in users)

    # -- the thread -------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Queue the users the log holds pending turns for (work left by a stop), then start the thread. A
        running worker is left as it is; a stopped one starts again (an app's lifespan may run more than once)."""
        if self._thread is not None and self._thread.is_alive():
            return
        with self._cond:
            self._stop = False
        self.rescan()
        self._next_rescan = self.clock() + self.config.rescan_interval_s
        self._thread = threading.Thread(target=self._run, name="kvmem-formation", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None

    def idle(self) -> bool:
        """Nothing queued that is due, and no pass running."""
        with self._cond:
            now = self.clock()
            return self._busy is None and not any(t <= now for t in self._queue.values())

    def wait_idle(self, timeout_s: float = 30.0) -> bool:
        """Block until `idle()` (tests, benchmarks); False on timeout."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.idle():
                return True
            time.sleep(0.01)
        return self.idle()

    def _next_user(self) -> str | None:
        """The first due user, or None after waiting (under self._cond)."""
        while not self._stop:
            now = self.clock()
            if now >= self._next_rescan:
                self._next_rescan = now + self.config.rescan_interval_s
                self._cond.release()
                try:
                    self.rescan()
                except Exception:
                    log.exception("formation: rescanning the log for pending turns failed")
                finally:
                    self._cond.acquire()
                continue
            due = next((u for u, t in self._queue.items() if t <= now), None)
            if due is not None:
                del self._queue[due]
                self.stats.queued_users = len(self._queue)
                self._busy = due
                return due
            wake = min([*self._queue.values(), self._next_rescan]) - now
            self._cond.wait(timeout=max(0.001, min(wake, 1.0)))
        return None

    def _run(self) -> None:
        while True:
            with self._cond:
                user = self._next_user()
            if user is None:
                return
            try:
                result = self.form_user(user)
                if result.num_turns == self.config.batch_turns and result.error is None:
                    self.submit(user)  # more pending than one batch
            except Exception as e:  # a store failure: the turns stay pending; try again later
                log.exception("formation: forming %r failed", user)
                self.stats.failures_total += 1
                self.stats.last_error = f"{type(e).__name__}: {e}"
                self.submit(user, not_before=self.clock() + self.config.retry_backoff_s)
            finally:
                with self._cond:
                    self._busy = None
                    self._cond.notify_all()

    # -- one pass ---------------------------------------------------------------------------------------------
    def form_user(self, user_id: str) -> PassResult:
        """Form memories from the user's oldest pending turns (one batch); synchronous."""
        turns = self.store.pending_turns(user_id, limit=self.config.batch_turns)
        if not turns:
            return PassResult(0, 0, 0, 0, 0)
        ids = [t.id for t in turns]
        try:
            facts = self.extractor.extract([to_input(t) for t in turns])
        except ExtractionError as e:
            return self._failed(user_id, turns, e)
        said = {t.id: t.chat_time for t in turns}
        adds, duplicates, supersessions = self._consolidate(user_id, facts, said)
        result = self.store.commit_formed(
            user_id, ids, adds, duplicates, supersessions, extractor=self.extractor.name
        )
        self.stats.formed_turns_total += len(ids)
        self.stats.memories_added_total += len(result.added)
        self.stats.superseded_total += len(result.superseded_ids)
        self.stats.duplicates_total += len(duplicates)
        return PassResult(
            len(ids), len(result.added), len(duplicates), len(result.superseded_ids), result.dropped
        )

    def _failed(self, user_id: str, turns: Sequence[Any], error: ExtractionError) -> PassResult:
        attempts = 1 + max(t.attempts for t in turns)
        dead = not error.transient or attempts >= self.config.max_attempts
        reason = f"{self.extractor.name}: {error}"
        self.store.fail_turns(user_id, [t.id for t in turns], reason, dead=dead)
        self.stats.failures_total += 1
        self.stats.last_error = reason
        if dead:
            self.stats.dead_lettered_total += len(turns)
            log.warning("formation: %d turn(s) of %r dead-lettered: %s", len(turns), user_id, reason)
        else:
            delay = self.config.retry_backoff_s * 2 ** (attempts - 1)
            log.info(
                "formation: %r failed (attempt %d), retrying in %.1f s: %s", user_id, attempts, delay, reason
            )
            self.submit(user_id, not_before=self.clock() + delay)
        return PassResult(len(turns), 0, 0, 0, 0, error=reason, dead=dead)

    def _consolidate(
        self, user_id: str, facts: list[Fact], said: dict[str, str]
    ) -> tuple[list[Any], list[Any], list[Any]]:
        """Decisions for the batch against the user's served memories with the slots the facts set (or clear)
        and the nearest ones by embedding; returns commit_formed's adds, duplicates and supersessions.

        Which of two statements is newer goes by when each was said (`said`: turn id -> chat_time; a
        memory's chat_time), not by the date a fact names: "I moved to Berlin last month" said today retires
        "I live in Lisbon" said last week."""
        from kvmem.text.records import FormedMemory

        if not facts:
            return [], [], []
        existing: dict[str, ExistingMemory] = {}

        def consider(m: Any) -> None:
            existing.setdefault(
                m.id,
                ExistingMemory(
                    m.id, m.text, m.slot, m.slot_value, m.valid_from or m.chat_time, said_at=m.chat_time
                ),
            )

        for slot in sorted({s for f in facts for s in slots_touched(f)}):
            for m in self.store.slot_candidates(user_id, slot.rstrip("|"), prefix=slot.endswith("|")):
                consider(m)
        for fact in facts:
            for hit in self.store.search(
                user_id, fact.text, top_k=self.config.num_dense_candidates, mode="dense"
            ):
                consider(hit.memory)
        similarity = self._similarity([f.text for f in facts], [e.text for e in existing.values()])
        said_at = [max(said.get(t, "") for t in f.turn_ids) for f in facts]
        batch = consolidate_batch(facts, list(existing.values()), similarity, said_at=said_at)
        adds: list[Any] = []
        index_of: dict[int, int] = {}  # fact index -> add index
        duplicates: list[tuple[str, tuple[str, ...]]] = []
        for i, (fact, decision) in enumerate(zip(facts, batch.decisions, strict=True)):
            if decision.kind == "duplicate":
                # a duplicate of a fact of this batch adds nothing; of a stored memory, its turns
                duplicates.extend((t, fact.turn_ids) for t in decision.target_ids if t in existing)
                continue
            index_of[i] = len(adds)
            adds.append(
                FormedMemory(
                    text=as_sentence(fact.text),
                    source_turn_ids=fact.turn_ids,
                    valid_from=fact.valid_from,
                    chat_time=said_at[i] or fact.valid_from,  # when it was said
                    session_id=None,
                    slot=fact.slot,
                    slot_value=fact.value,
                    kind=fact.kind,
                )
            )
        batch_index = {batch_ref(i): i for i in range(len(facts))}
        supersessions: list[tuple[str | int, int]] = []
        for s in batch.supersessions:
            if s.new_index not in index_of:
                continue
            if s.old_id in batch_index:  # an earlier fact of this batch: added already superseded
                if batch_index[s.old_id] in index_of:
                    supersessions.append((index_of[batch_index[s.old_id]], index_of[s.new_index]))
            elif s.old_id in existing:
                supersessions.append((s.old_id, index_of[s.new_index]))
        return adds, duplicates, supersessions

    def _similarity(self, fact_texts: list[str], other_texts: list[str]) -> Callable[[str, str], float]:
        """Cosine of the store's embeddings, for the texts of this batch (one embedding call)."""
        texts = list(dict.fromkeys([*fact_texts, *other_texts]))
        if not texts:
            return lambda a, b: 0.0
        vectors = self.store.embedder.embed(texts)  # [n, dim], unit rows
        row = {t: i for i, t in enumerate(texts)}

        def cosine(a: str, b: str) -> float:
            if a not in row or b not in row:
                return 0.0
            return float(np.dot(vectors[row[a]], vectors[row[b]]))

        return cosine
