"""The in-process task queue between the request path and the scheduler's worker.

`put` never blocks (unbounded deque; refresh tasks for a user are coalesced, since a refresh is idempotent).
A Redis Streams queue for several workers is not implemented yet; this is the embedded default.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Task:
    kind: str  # "access" | "refresh" | "prewarm" | "evict"
    user_id: str | None = None
    payload: Any = None


class InProcessQueue:
    def __init__(self) -> None:
        self._items: deque[Task] = deque()
        self._pending_refresh: set[str] = set()
        self._cond = threading.Condition()

    def put(self, task: Task) -> None:
        with self._cond:
            if task.kind == "refresh":
                if task.user_id in self._pending_refresh:
                    return
                self._pending_refresh.add(task.user_id)
            self._items.append(task)
            self._cond.notify()

    def get(self, timeout_s: float | None = None) -> Task | None:
        with self._cond:
            if not self._items and not self._cond.wait_for(lambda: bool(self._items), timeout=timeout_s):
                return None
            task = self._items.popleft()
            if task.kind == "refresh":
                self._pending_refresh.discard(task.user_id)
            return task

    def __len__(self) -> int:
        return len(self._items)
