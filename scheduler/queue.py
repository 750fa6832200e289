"""Task queues between the request path and the scheduler's workers; `put` never blocks on I/O in either.

`InProcessQueue` (default): a user's access events and refreshes coalesce into one entry, bounded (below). `RedisStreamsQueue`: a stream + consumer
group shared by workers; ack after the task ran, XAUTOCLAIM of a dead worker's entries (at-least-once); an
outbox thread sends, and what it cannot send runs in process. JSON payloads only. Knows nothing of tasks' work.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import threading
from collections import deque
from dataclasses import asdict, dataclass, is_dataclass
from typing import Any

from scheduler.heat import AccessEvent

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Task:
    kind: str  # "access" | "refresh" | "prewarm" | "evict"
    user_id: str | None = None
    payload: Any = None
    entry_id: str | None = None  # the Redis stream entry, to acknowledge after the task ran


MAX_TASKS = 10_000  # distinct queued entries in process (a user's work is one entry): the overflow rule below
MAX_EVENTS_PER_USER = 256  # access events one user's entry keeps; past that the oldest is dropped


@dataclass
class _Entry:
    task: Task  # refresh | prewarm | evict | anything else, or the user's coalesced access
    events: list[AccessEvent]


class InProcessQueue:
    """FIFO of entries, coalesced so its size is bounded by users, not by turns.

    A user's access events are one entry (`Task("access", user, (event, ...))`; one event as itself), and a
    refresh merges into it (the worker refreshes after applying them) or is one refresh entry of its own;
    every event still adds its heat, the worker then refreshes once. The evict is one entry, and so is a user's
    prewarm (a session's start, the prewarm route): one queued while another of the same user waits merges into
    it, since the one that runs warms the block all the same (a client asking again each few seconds while a
    build runs once left hundreds of prewarms, each a file read, to run long after). Bounded: at most `max_tasks` entries; a task that would need a
    new entry past that is dropped and counted in `dropped` (one that merges into a queued entry never is);
    an entry keeps at most `max_events_per_user` events, the oldest dropped first (counted too). What a drop
    loses is heat (ranking) or a refresh the user's next turn asks for again, never correctness: deletes do
    not go through the queue."""

    def __init__(self, max_tasks: int = MAX_TASKS, max_events_per_user: int = MAX_EVENTS_PER_USER) -> None:
        assert max_tasks >= 1 and max_events_per_user >= 1, (max_tasks, max_events_per_user)
        self.max_tasks, self.max_events_per_user = max_tasks, max_events_per_user
        self._entries: dict[Any, _Entry] = {}  # insertion order is the FIFO order
        self._seq = 0  # keys of tasks that never merge
        self._cond = threading.Condition()
        self.dropped = 0  # tasks and events dropped by the bound
        # handed out by `get`, not yet acked: still in the queue's length (a flush waits on it)
        self._taken = 0

    def _key(self, task: Task) -> Any:
        if task.kind == "refresh" and ("access", task.user_id) in self._entries:
            return ("access", task.user_id)  # a queued access refreshes anyway: the refresh merges into it
        if task.kind in ("access", "refresh", "evict", "prewarm"):  # a prewarm queued twice warms once
            return (task.kind, task.user_id)
        self._seq += 1  # anything else: its own entry
        return ("once", self._seq)

    def put(self, task: Task) -> None:
        with self._cond:
            key = self._key(task)
            entry = self._entries.get(key)
            if entry is None:
                if len(self._entries) >= self.max_tasks:
                    self.dropped += 1
                    log.warning(
                        "scheduler queue full (%d entries); %s task dropped", self.max_tasks, task.kind
                    )
                    return
                entry = self._entries[key] = _Entry(task, [])
            if task.kind == "access":
                entry.task = Task("access", task.user_id)
                events = task.payload if isinstance(task.payload, (tuple, list)) else (task.payload,)
                entry.events.extend(events)
                if len(entry.events) > self.max_events_per_user:
                    over = len(entry.events) - self.max_events_per_user
                    del entry.events[:over]
                    self.dropped += over
            self._cond.notify()

    def get(self, timeout_s: float | None = None) -> Task | None:
        with self._cond:
            if not self._entries and not self._cond.wait_for(lambda: bool(self._entries), timeout=timeout_s):
                return None
            key = next(iter(self._entries))
            entry = self._entries.pop(key)
            self._taken += 1
            if entry.task.kind == "access":  # one event as itself (as Redis hands it), several as a tuple
                events = entry.events
                return Task("access", entry.task.user_id, events[0] if len(events) == 1 else tuple(events))
            return entry.task

    def ack(self, task: Task) -> None:
        """The task taken by `get` ran (or failed for good): it leaves the queue's length."""
        with self._cond:
            self._taken = max(0, self._taken - 1)

    def close(self) -> None:
        """Nothing to release."""

    def __len__(self) -> int:
        """Entries queued, and tasks taken but not acked yet: a worker between `get` and running the task it
        took still counts, so `len() == 0` means every task put so far has run."""
        return len(self._entries) + self._taken


def _encode(task: Task) -> str:
    payload = asdict(task.payload) if is_dataclass(task.payload) else task.payload
    return json.dumps({"kind": task.kind, "user_id": task.user_id, "payload": payload})


def _decode(raw: str | bytes, entry_id: str) -> Task:
    data = json.loads(raw)
    payload = data.get("payload")
    if data["kind"] == "access" and payload is not None:
        payload = AccessEvent(
            payload["user_id"],
            tuple(payload["retrieved_ids"]),
            tuple(payload["used_ids"]),
            float(payload["at"]),
            payload.get("session_id"),
        )
    return Task(data["kind"], data.get("user_id"), payload, entry_id)


class RedisStreamsQueue:
    """A Redis stream with one consumer group; this object is one consumer. Needs the `redis` package."""

    def __init__(
        self,
        url: str,
        *,
        stream: str = "kvmem:scheduler",
        group: str = "workers",
        consumer: str | None = None,
        min_idle_ms: int = 30_000,
    ):
        import redis

        if consumer is None:  # unique per process: two replicas must never read as one consumer
            consumer = unique_consumer_name()
        self._redis_errors = (redis.ConnectionError, redis.TimeoutError)
        self.client = redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=2)
        self.stream, self.group, self.consumer, self.min_idle_ms = stream, group, consumer, min_idle_ms
        self._local = InProcessQueue()  # used while Redis is unreachable
        try:
            self.client.xgroup_create(stream, group, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        self._outbox: deque[Task] = deque()
        self._outbox_cond = threading.Condition()
        self._sending = False
        self._taken = 0  # entries handed out by `get` from the stream, not acked yet (see InProcessQueue)
        self._closed = False
        self._sender = threading.Thread(target=self._send_loop, name="kvmem-redis-outbox", daemon=True)
        self._sender.start()

    def put(self, task: Task) -> None:
        """Never blocks on Redis: the task is handed to the outbox thread."""
        with self._outbox_cond:
            self._outbox.append(task)
            self._outbox_cond.notify()

    def _send_loop(self) -> None:
        while True:
            with self._outbox_cond:
                self._outbox_cond.wait_for(lambda: self._outbox or self._closed)
                if not self._outbox:
                    return
                task = self._outbox.popleft()
                self._sending = True
            try:
                self.client.xadd(self.stream, {"task": _encode(task)})
            except self._redis_errors as exc:
                log.warning("redis unreachable (%s); running task %s in process", exc, task.kind)
                self._local.put(task)
            finally:
                with self._outbox_cond:
                    self._sending = False
                    self._outbox_cond.notify_all()

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every task put so far was sent to Redis (or kept in process). False on timeout."""
        with self._outbox_cond:
            return self._outbox_cond.wait_for(
                lambda: not self._outbox and not self._sending, timeout=timeout_s
            )

    def close(self) -> None:
        """Send what is in the outbox, stop the outbox thread, and leave the group if nothing of ours is
        pending (a pending entry keeps the consumer, so XAUTOCLAIM can hand it to a live worker)."""
        with self._outbox_cond:
            self._closed = True
            self._outbox_cond.notify_all()
        self._sender.join(timeout=10)
        try:
            mine = self.client.xpending_range(
                self.stream, self.group, "-", "+", 1, consumername=self.consumer
            )
            if not mine:
                self.client.xgroup_delconsumer(self.stream, self.group, self.consumer)
        except self._redis_errors as exc:
            log.warning("redis unreachable (%s); consumer %s stays in the group", exc, self.consumer)

    def get(self, timeout_s: float | None = None) -> Task | None:
        local = self._local.get(timeout_s=0)
        if local is not None:
            return local
        self.flush(timeout_s=1.0 if timeout_s is None else timeout_s)  # what this process put comes first
        local = self._local.get(timeout_s=0)
        if local is not None:
            return local
        try:
            _, claimed, *_ = self.client.xautoclaim(
                self.stream, self.group, self.consumer, self.min_idle_ms, start_id="0-0", count=1
            )
            entries = claimed
            if not entries:
                block = None if timeout_s is None else max(1, int(timeout_s * 1000))
                reply = self.client.xreadgroup(
                    self.group, self.consumer, {self.stream: ">"}, count=1, block=block
                )
                entries = reply[0][1] if reply else []
        except self._redis_errors as exc:
            log.warning("redis unreachable (%s); serving in-process tasks only", exc)
            return self._local.get(timeout_s=timeout_s)
        if not entries:
            return None
        entry_id, fields = entries[0]
        entry_id = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
        task = _decode(fields[b"task"] if b"task" in fields else fields["task"], entry_id)
        with self._outbox_cond:
            self._taken += 1
        return task

    def ack(self, task: Task) -> None:
        if task.entry_id is None:  # one run in process (Redis was unreachable)
            self._local.ack(task)
            return
        with self._outbox_cond:
            self._taken = max(0, self._taken - 1)
        try:  # a done task's entry leaves the stream too: acked alone, the stream grew by every task forever
            pipe = self.client.pipeline(transaction=True)
            pipe.xack(self.stream, self.group, task.entry_id)
            pipe.xdel(self.stream, task.entry_id)
            pipe.execute()
        except self._redis_errors as exc:
            log.warning(
                "redis unreachable (%s); task %s stays pending and will be redone", exc, task.entry_id
            )

    def pending(self) -> int:
        return int(self.client.xpending(self.stream, self.group)["pending"])

    def __len__(self) -> int:
        """Entries not yet delivered (the group's lag), delivered and not acked (its pending list: this counts
        an entry from the moment XREADGROUP hands it out, before `get` returns and counts it in `_taken`, a
        window in which flush saw an empty queue), and what this process holds."""
        try:
            info = self.client.xinfo_groups(self.stream)
            mine = next((g for g in info if g["name"] in (self.group, self.group.encode())), {})
            lag, pending = int(mine.get("lag") or 0), int(mine.get("pending") or 0)
            return lag + max(pending, self._taken) + len(self._local) + len(self._outbox) + self._sending
        except self._redis_errors:
            return len(self._local) + len(self._outbox) + self._sending + self._taken


def unique_consumer_name() -> str:
    """host-pid-random: distinct across machines, processes, and queues in one process."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"


def require_redis(url: str, timeout_s: float = 2.0) -> None:
    """Raises kvmem.errors.DependencyUnavailable naming Redis and where when `url` does not answer a PING
    (serving's start: replicas must not run without the shared fence and queue)."""
    import redis

    from kvmem.errors import DependencyUnavailable, url_where

    try:
        client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        try:
            client.ping()
        finally:
            client.close()
    except (redis.RedisError, OSError, ValueError) as exc:
        raise DependencyUnavailable("redis", url_where(url), str(exc) or type(exc).__name__) from exc


def make_queue(
    redis_url: str | None, *, max_tasks: int = MAX_TASKS, **kwargs: Any
) -> InProcessQueue | RedisStreamsQueue:
    """Redis Streams when a URL is given and Redis answers; else (with a log line) the in-process queue, of at
    most `max_tasks` entries."""
    if not redis_url:
        return InProcessQueue(max_tasks)
    try:
        queue = RedisStreamsQueue(redis_url, **kwargs)
        queue.client.ping()
        return queue
    except Exception as exc:  # noqa: BLE001 - any failure to reach Redis means the in-process fallback
        log.warning("redis at %s unusable (%s); using the in-process queue", redis_url, exc)
        return InProcessQueue(max_tasks)


__all__ = [
    "InProcessQueue",
    "RedisStreamsQueue",
    "Task",
    "make_queue",
    "require_redis",
    "unique_consumer_name",
]
