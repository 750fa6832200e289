"""The one thread that runs the model: every request's steps and every block build, taking turns.

Why one thread: each thread that runs torch CPU kernels gets its own OpenMP team, and teams of threads that
ran a moment ago still spin on the cores the next forward needs. With a generation thread per request, a
1.7k-token KV prefill ran ~45 ms slower in the server after a burst of 8 concurrent requests than in a
one-thread process; on one thread it runs as fast. Requests are generators; each turn advances every one of
them a step, in order, then the batcher once. A generator that yields an `EngineSequence` (sequence.py) joins
the batcher (batcher.py): its sequences advance together, one forward per turn for their decode rows and
the prefill chunks of new ones, so a new request's prefill waits for one decode step, not for generations.
Builds are plain calls, run between turns, whose caller waits for the result. A generator waiting for pages
yields an `AdmissionWait` (sequence.py): it is parked, not stepped, until the wait is ready, and the thread
sleeps while nothing else runs, woken by `wake` (the page pool calls it when room may have appeared, a
request's stream when its client left) or by the nearest deadline. What the requests send to their streams
goes through `handoff` (handoff.py), flushed once per turn, after the step: one event-loop hop per turn, not
one per token.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

from serving.engine.batcher import Batcher
from serving.engine.handoff import Handoff
from serving.engine.sequence import AdmissionWait, EngineSequence

log = logging.getLogger(__name__)


class LoopClosed(RuntimeError):
    """The model loop was closed; nothing more runs on it."""


class ModelLoop:
    def __init__(self, name: str = "kvmem-model", prefill_budget_tokens: int = 512) -> None:
        self._batcher = Batcher(prefill_budget_tokens)
        self.handoff = Handoff()  # the requests' items for their streams; flushed after every turn
        self._cv = threading.Condition()
        self._incoming: deque[Iterator[Any] | tuple[Future, Callable[[], Any]]] = deque()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def start(self, steps: Iterator[Any]) -> None:
        """Advance `steps` one `next` per turn on the model thread until it is exhausted, or until it yields a
        `EngineSequence`: from then on the batcher resumes it with that sequence's tokens (batcher.py). It must handle
        its own errors (an exception out of it is logged and the generator dropped)."""
        self._put(steps)

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run fn() on the model thread between two steps; wait for it and return its result (or raise)."""
        return self.call_soon(fn).result()

    def call_soon(self, fn: Callable[[], Any]) -> Future:
        """Run fn() on the model thread between two steps, without waiting: its future. Raises LoopClosed."""
        future: Future = Future()
        self._put((future, fn))
        return future

    def wake(self) -> None:
        """Something a parked generator waits for may have happened: look again (any thread)."""
        with self._cv:
            self._cv.notify()

    def _listen(self, pool) -> None:
        """Be woken by `pool` when room may appear in it (a parked admission, a stalled batcher wait for it)."""
        with pool.lock:
            if self.wake not in pool.listeners:
                pool.listeners.append(self.wake)

    def close(self) -> None:
        """Stop after the current step; requests still running are dropped, waiting calls get LoopClosed."""
        with self._cv:
            self._closed = True
            self._cv.notify()

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    def _put(self, job: Iterator[Any] | tuple[Future, Callable[[], Any]]) -> None:
        with self._cv:
            if self._closed:
                raise LoopClosed("the model loop is closed")
            self._incoming.append(job)
            self._cv.notify()

    def _run(self) -> None:
        active: deque[Iterator[Any]] = deque()
        parked: list[tuple[Iterator[Any], AdmissionWait]] = []  # waiting for pages (or a stop, or a deadline)
        while True:
            with self._cv:
                while True:
                    ready = [p for p in parked if p[1].ready()]
                    if (
                        self._incoming
                        or active
                        or ready
                        or (self._batcher and not self._batcher.idle())
                        or self._closed
                    ):
                        break
                    # the nearest deadline: a parked admission's, or a stalled preempted member's (batcher.py)
                    deadlines = [w.deadline for _, w in parked]
                    stall = self._batcher.deadline() if self._batcher else None
                    deadline = min([*deadlines, *([] if stall is None else [stall])], default=None)
                    self._cv.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
                if self._closed:
                    break
                new = list(self._incoming)
                self._incoming.clear()
            for steps, wait in ready:
                parked.remove((steps, wait))
                active.append(steps)
            for job in new:
                if isinstance(job, tuple):
                    self._call(*job)
                else:
                    active.append(job)
            for _ in range(len(active)):  # one turn each, in order
                steps = active.popleft()
                yielded = self._step(steps)
                if isinstance(yielded, EngineSequence):
                    self._listen(yielded.table.pool)
                    self._batcher.add(yielded, steps)
                elif isinstance(yielded, AdmissionWait):
                    self._listen(yielded.pool)
                    parked.append((steps, yielded))
                elif yielded:
                    active.append(steps)
            if self._batcher and not self._batcher.idle():
                self._batcher.step()
            self.handoff.flush()
        for steps in [*active, *(steps for steps, _ in parked)]:
            steps.close()
        self._batcher.close()
        with self._cv:
            for job in self._incoming:
                if isinstance(job, tuple):
                    job[0].set_exception(LoopClosed("the model loop is closed"))
                else:
                    job.close()
            self._incoming.clear()
        self.handoff.flush()

    @staticmethod
    def _call(future: Future, fn: Callable[[], Any]) -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn())
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            future.set_exception(exc)

    @staticmethod
    def _step(steps: Iterator[Any]) -> EngineSequence | AdmissionWait | bool:
        """One step: the EngineSequence or AdmissionWait it yielded, else True; False once it is done (or
        failed, which it should not)."""
        try:
            yielded = next(steps)
            return yielded if isinstance(yielded, EngineSequence | AdmissionWait) else True
        except StopIteration:
            return False
        except Exception:  # noqa: BLE001 - the loop must outlive any one request
            log.exception("a request's steps raised out of the model loop; request dropped")
            return False
