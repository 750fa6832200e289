"""Memory formation in the background: a user's pending log turns -> atomic memories, deduplicated and
superseding what they contradict, never on the request path (DESIGN invariant 8).

Owns the queue of users with pending turns (bounded, coalesced per user), the thread that drains it, and what
a failure does. The turns themselves wait in the store's conversation log (state 'pending'), so nothing is
lost when the queue is full or the process stops: a full queue refuses the user, counts it (`overflowed`), and
the next rescan of the log (every `rescan_interval_s`, and at start) picks the user up. A transient failure
(the extractor is down) never dead-letters: the turns stay pending, the user backs off (up to
`max_backoff_s`), and after `circuit_failures` such failures in a row the circuit opens (no pass at all) until
one probe pass gets an answer, which resumes every user. A permanent failure (a malformed reply) bisects the
batch, so only the single turns that fail alone are dead-lettered. What a turn says is the extractor's business
(kvmem.formation); what a new fact does to old ones is consolidation's (kvmem.formation.consolidate, over
the candidates formation_decisions.py gathers); the store commits both in one transaction. A failure's kind and time are public (/health); its text, which may
quote a reply that repeats a user's words, is kept with that user's turns only, and never logged. Knows
nothing of HTTP.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta, timezone
from typing import Any

from kvmem.formation.base import Extractor
from kvmem.formation.errors import ExtractionError
from kvmem.text.errors import InvalidMemoryInput, StaleFormation
from kvmem.utc import utc_text
from scheduler.formation_decisions import decide
from scheduler.formation_speakers import decide_by_speaker
from scheduler.formation_types import FormationConfig, FormationStats, PassResult, Tally, to_input

log = logging.getLogger(__name__)


def _utc(moment: datetime) -> str:
    return utc_text(moment)


class FormationWorker:
    """One thread forming memories for the users queued with `submit`. Thread-safe.

    `clock` (monotonic seconds) times backoffs and the circuit; `wall_clock` stamps the last error's time;
    `decider(store, user_id, facts, said, num_dense_candidates)` turns a batch's facts into the store's rows
    (formation_decisions.decide: consolidation's rules; the "self" extractor's model decisions)."""

    def __init__(
        self,
        store: Any,
        extractor: Extractor,
        config: FormationConfig | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], datetime] = lambda: datetime.now(timezone.utc),
        decider: Callable[..., tuple] = decide,
    ) -> None:
        self.store, self.extractor, self.decider = store, extractor, decider
        self.config = config or FormationConfig()
        self.clock, self.wall_clock = clock, wall_clock
        self._queue: OrderedDict[str, float] = OrderedDict()  # user -> not before (clock), oldest first
        self._cond = threading.Condition()
        self._busy: str | None = None  # the user being formed now
        self._stop = False
        self._running = False  # a thread runs (or is finishing its pass after a stop); under self._cond
        self._circuit_wait = 0.0  # how long the circuit was last opened for (a failed probe doubles it)
        self._stale: dict[str, int] = {}  # user -> stale passes in a row (commit_formed's StaleFormation)
        self._thread: threading.Thread | None = None
        self._next_rescan = 0.0
        self._failures_in_row = 0  # transient failures since the extractor last answered (any users)
        self._circuit_until: float | None = None  # open until then (clock); None: closed
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
            self._stale.pop(user_id, None)

    def rescan(self) -> int:
        """Queue every user the log holds pending turns for; returns how many were queued."""
        users = self.store.users_with_pending_turns()
        # a user already queued keeps their time: one backing off after failures is not made due again
        return sum(self.submit(u, not_before=self.clock()) for u in users)

    def requeue_all_dead(self) -> int:
        """An operator's call: every user's dead-lettered turns go back to formation (pending, attempts 0),
        and their users are queued; returns how many turns."""
        requeued = self.store.requeue_all_dead_turns()
        if requeued:
            self.rescan()
        return requeued

    # -- the thread -------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Queue the users the log holds pending turns for (work left by a stop), then start the thread. A
        running worker is left as it is, and one told to stop that is still in its pass (a stop that timed out)
        runs on: never two threads forming at once. A stopped one starts again (an app's lifespan may run more
        than once)."""
        with self._cond:
            self._stop = False
            running, self._running = self._running, True  # this call starts the thread; another start sees it
            if running:
                self._cond.notify_all()
        try:
            self.rescan()
            if running:
                return
            self._next_rescan = self.clock() + self.config.rescan_interval_s
            self._thread = threading.Thread(target=self._run, name="kvmem-formation", daemon=True)
            self._thread.start()
        except BaseException:
            if not running:
                with self._cond:
                    self._running = False
            raise

    def stop(self, timeout_s: float = 10.0) -> None:
        """Tell the thread to stop and wait up to `timeout_s` for its pass to end; a thread still in its pass
        then is kept (`start` lets it run on rather than start a second)."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if not self._thread.is_alive():
                self._thread = None

    def idle(self) -> bool:
        """Nothing queued that may run now (due, and the circuit lets it through), and no pass running."""
        with self._cond:
            return self._busy is None and self._due(self.clock())[0] is None

    def wait_idle(self, timeout_s: float = 30.0) -> bool:
        """Block until `idle()` (tests, benchmarks); False on timeout."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.idle():
                return True
            time.sleep(0.01)
        return self.idle()

    def _due(self, now: float) -> tuple[str | None, float]:
        """(the user to form now, or None; when to look again) under self._cond. An open circuit lets nothing
        through until it half-opens; then the user due first is the probe, due or not."""
        if self._circuit_until is not None:
            if now < self._circuit_until:
                return None, self._circuit_until
            if self._queue:
                return min(self._queue, key=self._queue.__getitem__), now
        due = next((u for u, t in self._queue.items() if t <= now), None)
        return due, min(self._queue.values(), default=math.inf)

    def _take(self, now: float) -> str | None:
        """Pop the user `_due` names and mark it busy (under self._cond)."""
        user, _ = self._due(now)
        if user is not None:
            del self._queue[user]
            self.stats.queued_users = len(self._queue)
            self._busy = user
        return user

    def run_once(self) -> PassResult | None:
        """The pass the thread would run now, if any user may be formed now (tests, tools); synchronous."""
        with self._cond:
            user = self._take(self.clock())
        if user is None:
            return None
        try:
            return self._pass(user)
        finally:
            with self._cond:
                self._busy = None
                self._cond.notify_all()

    def _next_user(self) -> str | None:
        """The next user to form, or None once stopped, waiting as long as there is none (under self._cond)."""
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
            user = self._take(now)
            if user is not None:
                return user
            wake = min(self._due(now)[1], self._next_rescan) - now
            self._cond.wait(timeout=max(0.001, min(wake, 1.0)))
        return None

    def _run(self) -> None:
        stopped = False
        try:
            while True:
                with self._cond:
                    user = self._next_user()
                    if user is None:  # stopped: under the lock, so a start() sees either a thread or none
                        self._running, stopped = False, True
                        return
                try:
                    self._pass(user)
                finally:
                    with self._cond:
                        self._busy = None
                        self._cond.notify_all()
        finally:
            if not stopped:  # an error no pass caught ended the thread: a start() may start another
                with self._cond:
                    self._running = False

    def _pass(self, user: str) -> PassResult | None:
        """form_user, requeueing the user when more is pending; a store failure leaves the turns pending and
        tries again later (logged by its exception type only: its message may quote a turn)."""
        try:
            result = self.form_user(user)
        except Exception as e:
            log.error("formation: forming %r failed (%s); its turns stay pending", user, type(e).__name__)
            self._record_error(f"store:{type(e).__name__}")
            now = self.clock()
            with self._cond:
                # a half-open circuit's probe failed: open it again, longer
                if self._circuit_until is not None:
                    self._open_circuit(now, min(self.config.max_backoff_s, 2 * self._circuit_wait))
            self.submit(user, not_before=now + self.config.retry_backoff_s)
            return None
        if result.num_turns == self.config.batch_turns and not result.transient:
            self.submit(user)  # more pending than one batch
        return result

    # -- one pass ---------------------------------------------------------------------------------------------
    def form_user(self, user_id: str) -> PassResult:
        """Form memories from the user's oldest pending turns (one batch); synchronous."""
        turns = self.store.pending_turns(user_id, limit=self.config.batch_turns)
        if not turns:
            return PassResult(0, 0, 0, 0, 0)
        tally = Tally()
        stale = self._stale.get(user_id, 0)
        self._form(user_id, list(turns), tally)
        if self._stale.get(user_id, 0) == stale:  # the pass ended otherwise than stale: the run of them ends
            self._stale.pop(user_id, None)
        return PassResult(
            len(turns),
            tally.added,
            tally.duplicates,
            tally.superseded,
            tally.dropped,
            error=tally.error,
            num_dead=tally.dead,
            transient=tally.transient,
        )

    def _form(self, user_id: str, turns: list[Any], tally: Tally) -> bool:
        """Extract and commit these turns, bisecting on a permanent failure down to single turns, which are
        dead-lettered; False when a transient failure stopped the pass (the turns not formed stay pending)."""
        try:
            facts = self.extractor.extract([to_input(t) for t in turns])
        except ExtractionError as e:
            tally.error = f"{self.extractor.name}: {e}"
            if e.transient:
                self._transient(user_id, turns, e, tally.error)
                tally.transient = True
                return False
            self._answered()  # the extractor answered: its endpoint is up
            return self._permanent(user_id, turns, tally, e.kind)
        self._answered()
        ids = [t.id for t in turns]
        said = {t.id: t.chat_time for t in turns}
        generation = self.store.generation(user_id)  # what the decisions read; the commit checks it
        try:  # consolidation's rules, or the extractor's own decisions ("self": kvmem/formation/self_model.py)
            adds, duplicates, supersessions, outdated = decide_by_speaker(
                self.decider,
                self.store,
                user_id,
                facts,
                said,
                self.config.num_dense_candidates,
                {t.id: t for t in turns},
            )
        except ExtractionError as e:  # a decision the model could not finish
            tally.error = f"{self.extractor.name}: {e}"
            if not e.transient:  # cut at its max_tokens, say: the same turns fail the same way (greedy)
                return self._permanent(user_id, turns, tally, e.kind)
            self._transient(user_id, turns, e, tally.error)  # the turns stay pending
            tally.transient = True
            return False
        try:
            result = self.store.commit_formed(
                user_id,
                ids,
                adds,
                duplicates,
                supersessions,
                extractor=self.extractor.name,
                outdated=outdated,
                expect_generation=generation,
            )
        except StaleFormation:  # the memories changed while it decided: decide again over what is there now
            self.stats.stale_total += 1
            stale = self._stale[user_id] = self._stale.get(user_id, 0) + 1
            # at once the first time; then backing off, so a client writing all the time is not raced forever
            delay = 0.0 if stale == 1 else self._backoff(stale - 2)
            self.submit(user_id, not_before=self.clock() + delay)
            tally.transient = True  # the turns stay pending; no more passes of this batch now
            return False
        except InvalidMemoryInput as e:  # a fact the store refuses (e.g. a date it cannot hold): never stored
            tally.error = f"{self.extractor.name}: the store refused a formed fact: {e}"
            return self._permanent(user_id, turns, tally, "store_refused")
        if result.requeued:  # restatements of a memory deleted meanwhile: formed again on their own
            self.submit(user_id)
        self.stats.formed_turns_total += len(ids)
        self.stats.memories_added_total += len(result.added)
        self.stats.superseded_total += len(result.superseded_ids)
        self.stats.duplicates_total += len(duplicates)
        tally.added += len(result.added)
        tally.duplicates += len(duplicates)
        tally.superseded += len(result.superseded_ids)
        tally.dropped += result.dropped
        return True

    def _permanent(self, user_id: str, turns: list[Any], tally: Tally, kind: str) -> bool:
        """A failure that retrying the same turns cannot mend: bisect the batch, so the other turns are formed,
        down to the single turn that fails, which is dead-lettered (tally.error the reason kept with it)."""
        if len(turns) > 1:
            half = len(turns) // 2
            return self._form(user_id, turns[:half], tally) and self._form(user_id, turns[half:], tally)
        self.store.fail_turns(user_id, [t.id for t in turns], tally.error, dead=True)
        self.stats.failures_total += 1
        self.stats.dead_lettered_total += 1
        self._record_error(kind)
        tally.dead += 1
        log.warning("formation: a turn of %r dead-lettered (%s)", user_id, kind)
        return True

    def _transient(self, user_id: str, turns: Sequence[Any], error: ExtractionError, reason: str) -> None:
        """The turns stay pending (attempts + 1, the reason kept with them); the user backs off, and enough
        failures in a row open the circuit."""
        attempts = 1 + max(t.attempts for t in turns)
        self.store.fail_turns(user_id, [t.id for t in turns], reason, dead=False)
        self.stats.failures_total += 1
        self._record_error(error.kind)
        now = self.clock()
        delay = self._backoff(attempts - 1)
        with self._cond:
            self._failures_in_row += 1
            beyond = self._failures_in_row - self.config.circuit_failures
            if beyond >= 0:
                self._open_circuit(now, self._backoff(beyond))
        log.info(
            "formation: %r failed (%s, attempt %d), retrying in %.1f s", user_id, error.kind, attempts, delay
        )
        if beyond >= 0:
            log.warning(
                "formation: the extractor failed %d times in a row (%s): circuit open",
                beyond + self.config.circuit_failures,
                error.kind,
            )
        self.submit(user_id, not_before=now + delay)

    def _backoff(self, doublings: int) -> float:
        """`retry_backoff_s` doubled `doublings` times, at most `max_backoff_s` (the power capped first: a long
        outage must not overflow it)."""
        return min(self.config.max_backoff_s, self.config.retry_backoff_s * 2 ** min(max(doublings, 0), 32))

    def _open_circuit(self, now: float, wait: float) -> None:
        """No pass for `wait` seconds, then one probe (under self._cond); /health says until when."""
        self._circuit_until, self._circuit_wait = now + wait, wait
        self.stats.circuit, self.stats.circuit_open = "open", 1
        self.stats.circuit_until = _utc(self.wall_clock() + timedelta(seconds=wait))

    def _answered(self) -> None:
        """The extractor answered: failures in a row end; an open circuit closes and every queued user is due."""
        with self._cond:
            self._failures_in_row = 0
            if self._circuit_until is None:
                return
            self._circuit_until = None
            self.stats.circuit, self.stats.circuit_open, self.stats.circuit_until = "closed", 0, None
            now = self.clock()
            for user in self._queue:
                self._queue[user] = min(self._queue[user], now)
            self._cond.notify_all()
        log.warning("formation: the extractor answers again: circuit closed")

    def _record_error(self, kind: str) -> None:
        self.stats.last_error_kind = kind
        self.stats.last_error_at = _utc(self.wall_clock())
