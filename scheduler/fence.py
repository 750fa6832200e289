"""The shared invalidation fence: a per-user generation counter in Redis, for replicas over one data dir.

A process that hears a memory change bumps the user's counter before the store call returns; every process
stamps a block with the counter it read before reading the memories it built from, and serves the block only
while the counter still reads the same. Owns the keys and what an unreachable Redis means (fail closed: no
block is served). Knows nothing of plans, blocks or memories.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kvmem.errors import DependencyUnavailable, url_where

log = logging.getLogger(__name__)


class FenceUnavailable(RuntimeError):
    """The counter could not be bumped: peers may serve the changed memory until a retry succeeds."""


class RedisFence:
    """`INCR`/`GET` of `{prefix}:{user_id}`. Needs the `redis` package.

    `read` is on the request path: a short socket timeout, and after a failure no call to Redis for
    `retry_after_s` (reads answer None at once), so a dead Redis costs one timeout, not one per request.
    A failed `bump` is remembered and retried by `retry_pending` (the worker's idle loop) until it lands.
    """

    def __init__(
        self,
        url: str,
        *,
        prefix: str = "kvmem:fence",
        timeout_s: float = 0.25,
        retry_after_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        import redis

        self._errors = (redis.ConnectionError, redis.TimeoutError)
        self.client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self.prefix, self.retry_after_s, self.clock = prefix, retry_after_s, clock
        self.where = url_where(url)
        self._down_until = 0.0
        self._lock = threading.Lock()
        self._unbumped: set[str] = set()  # users whose bump has not reached Redis yet

    def _key(self, user_id: str) -> str:
        return f"{self.prefix}:{user_id}"

    def bump(self, user_id: str) -> int:
        """Advance the user's generation; returns the new value. Raises FenceUnavailable (and remembers the
        user for `retry_pending`) when Redis cannot be reached."""
        try:
            value = int(self.client.incr(self._key(user_id)))
        except self._errors as exc:
            with self._lock:
                self._unbumped.add(user_id)
            raise FenceUnavailable(f"could not advance the fence of user {user_id!r}: {exc}") from exc
        with self._lock:
            self._unbumped.discard(user_id)
        return value

    def read(self, user_id: str) -> int | None:
        """The user's generation (0 if never bumped), or None when Redis cannot be reached: serve no block."""
        if self.clock() < self._down_until:
            return None
        try:
            raw = self.client.get(self._key(user_id))
        except self._errors as exc:
            self._down_until = self.clock() + self.retry_after_s
            log.warning("fence unreadable (%s): serving blocks as text for %.1fs", exc, self.retry_after_s)
            return None
        return 0 if raw is None else int(raw)

    def ping(self) -> None:
        """Raises DependencyUnavailable naming Redis when it does not answer now (a change made now could not
        stop peers serving the old memory: the caller refuses the change instead)."""
        try:
            self.client.ping()
        except self._errors as exc:
            raise DependencyUnavailable("redis", self.where, str(exc) or type(exc).__name__) from exc

    @property
    def unbumped(self) -> frozenset[str]:
        """Users whose last bump has not reached Redis yet."""
        with self._lock:
            return frozenset(self._unbumped)

    def retry_pending(self) -> None:
        with self._lock:
            users = sorted(self._unbumped)
        for user_id in users:
            try:
                self.bump(user_id)
                log.info("fence of user %r advanced on retry", user_id)
            except FenceUnavailable:
                return

    def close(self) -> None:
        self.client.close()
