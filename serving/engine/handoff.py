"""Items from the model thread to the streams reading them on an asyncio loop: one event-loop hop per turn.

A request's items (its token deltas, then its result or error) are made on the model thread (model_loop.py)
and read by its stream on an event loop. Handed over one by one (a `call_soon_threadsafe` per item), each
token of each stream woke the event loop on its own: at 32 streams, 32 self-pipe writes a step, and an event
loop that woke at the first of them and then competed for the GIL with the model thread still delivering the
step's other tokens. Here the model thread only buffers (`Handoff.put`); the model loop calls `flush` once per
turn, after the step, and every event loop with items gets them all in one call. A stream's `Inbox` holds
what it was sent; its reader takes everything there in one go (`take`), so a reader that fell behind catches
up without a wake-up per item. Items keep their order per stream.

Both `put` and `flush` run on the model thread; an item put is delivered at the next flush.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque


class Inbox:
    """One stream's items, on its event loop: filled by `Handoff.flush` (through the loop), read by `take`."""

    __slots__ = ("loop", "_items", "_waiter")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._items: deque[object] = deque()
        self._waiter: asyncio.Future | None = None

    def _push(self, item: object) -> None:
        """On the event loop."""
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def take(self, timeout_s: float) -> list[object]:
        """Every item sent and not yet taken, in order; waits up to `timeout_s` for one ([] when none came)."""
        if not self._items:
            self._waiter = self.loop.create_future()
            try:
                async with asyncio.timeout(timeout_s):
                    await self._waiter
            except TimeoutError:
                pass
            finally:
                self._waiter = None
        items = list(self._items)
        self._items.clear()
        return items


def _deliver(batch: list[tuple[Inbox, object]]) -> None:
    for inbox, item in batch:
        inbox._push(item)


class Handoff:
    """The model thread's outgoing items, buffered until the turn ends (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[asyncio.AbstractEventLoop, list[tuple[Inbox, object]]] = {}

    def put(self, inbox: Inbox, item: object) -> None:
        """Send `item` to `inbox` at the next `flush`."""
        with self._lock:
            self._pending.setdefault(inbox.loop, []).append((inbox, item))

    def flush(self) -> None:
        """Hand every buffered item to its event loop: one `call_soon_threadsafe` per loop with items."""
        with self._lock:
            if not self._pending:
                return
            pending, self._pending = self._pending, {}
        for loop, batch in pending.items():
            try:
                loop.call_soon_threadsafe(_deliver, batch)
            except RuntimeError:  # that event loop is closed: nothing reads its streams any more
                pass
