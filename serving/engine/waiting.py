"""The requests waiting for pages at admission, first come first served.

A request that finds the pool full waits (sequence.py `admit`: parked on the pool's changes, 429 after its
`wait_s`). Each time room appears every parked request tries again; without an order among them, small
requests that arrived later took each page freed before a large one that waited longer could: it was starved
until its 429 however long it had waited. Here a request that waits takes a ticket (`join`), in arrival order,
and is admitted only when no ticket before its own waits (`ahead`): the pages freed go to the oldest
waiting request first, as vLLM's scheduler takes its waiting queue in order. A new request that finds the pool
with room still waits while older ones do. Background rows (memory formation) never hold a chat request back:
a chat request counts only the chat tickets before it; a background one counts every ticket before it and
every chat ticket.

A ticket leaves when its request is admitted, gives up (deadline, client gone) or is closed (`leave`, from the
admission's `finally`), and the pool's room is said to have changed then, so the next one tries again. A
ticket past its deadline holds nobody back even if its request never left (a generator dropped unclosed).
Under the pool's lock.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Ticket:
    number: int
    background: bool
    deadline: float  # time.monotonic(): past it the ticket holds nobody back


class Waiting:
    def __init__(self, pool) -> None:  # pages.PagePool, which makes it
        self.pool = pool
        self._tickets: dict[int, Ticket] = {}  # in arrival order
        self._numbers = itertools.count()

    def __len__(self) -> int:
        with self.pool.lock:
            return len(self._tickets)

    def join(self, background: bool, deadline: float) -> Ticket:
        """A ticket for a request that waits from now until `deadline`, after everyone who waits."""
        with self.pool.lock:
            ticket = Ticket(next(self._numbers), background, deadline)
            self._tickets[ticket.number] = ticket
            return ticket

    def leave(self, ticket: Ticket) -> None:
        """The request is admitted or stopped waiting: the next one may take the pages (a change of the pool's
        room: its waiters look again)."""
        with self.pool.lock:
            if self._tickets.pop(ticket.number, None) is not None:
                self.pool.changed()

    def ahead(self, ticket: Ticket | None, background: bool) -> int:
        """How many waiting requests go before a request holding `ticket` (None: one that has not waited)."""
        with self.pool.lock:
            now, n = time.monotonic(), 0
            for t in self._tickets.values():
                if t is ticket or t.deadline <= now:
                    continue
                before = ticket is None or t.number < ticket.number
                if (before and (background or not t.background)) or (background and not t.background):
                    n += 1
            return n
