"""Plans: immutable snapshots of what is accelerated for each user, swapped atomically, for a bounded set of users.

`PlanBook.get` never blocks and never raises: readers take whatever snapshot is current (a dict read), an
unknown user gets an empty plan. The book holds at most `max_users` users' plans (a plan carries its block's
token ids: ~80 KB at 2,048 tokens); past that the least recently read or published is dropped from memory
only: its KV item stays stored, and the user's next read finds no plan, so the scheduler rebuilds it (the
content-addressed item is found again, not prefilled). Knows nothing of heat or how blocks are built.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class BlockPlan:
    item_id: str
    memory_ids: tuple[str, ...]
    texts: tuple[str, ...]
    num_tokens: int
    num_bytes: int
    token_ids: tuple[
        int, ...
    ] = ()  # the block's ids (DESIGN: a plan holds them); () when the builder had none
    # the served name of the LoRA adapter its K/V were computed under (None: the base model); it is served
    # only while that adapter version is the user's served adapter (Scheduler.get)
    adapter: str | None = None

    @classmethod
    def of(
        cls, built: Any, memory_ids: tuple[str, ...], texts: tuple[str, ...], adapter: str | None
    ) -> BlockPlan:
        """The plan's block for what a builder returned (a kvmem BuiltBlock or a fake with its fields)."""
        return cls(
            built.item_id,
            memory_ids,
            texts,
            built.num_tokens,
            built.num_bytes,
            tuple(built.token_ids),
            adapter,
        )


@dataclass(frozen=True)
class Plan:
    user_id: str
    block: BlockPlan | None = None
    adapter_id: str | None = None
    version: int = 0
    updated_at: float | None = None
    adapter: AdapterPlan | None = None  # the served LoRA adapter (adapter_id is its id), or None

    @property
    def covered_ids(self) -> frozenset[str]:
        """Memories the plan serves without text: the block's and the adapter's."""
        block = frozenset(self.block.memory_ids) if self.block else frozenset()
        return block | frozenset(self.adapter.memory_ids if self.adapter else ())


@dataclass(frozen=True)
class AdapterPlan:
    """A user's served LoRA adapter as a plan carries it: registry id, version, served name, the memories it is
    served for (they leave the prompt) and every memory trained into it."""

    adapter_id: str
    version: int
    name: str  # `<adapter_id>@v<version>-<sha16>`: a new version or new weights is a new name
    memory_ids: tuple[str, ...]  # served from the adapter: left out of the block and of the text
    trained_ids: tuple[str, ...] = ()  # in its weights: memory_ids and the facts it did not fully recall


class PlanBook:
    """Writers (publish, register, drop to the bound) hold `_write`; readers never take it. Recency is a tick per
    user in `_last_use`, stamped by reads and writes: a plain dict store, atomic under the GIL, so a read stays
    lock-free. Eviction scans for the oldest stamp (O(users), only when a new user would pass the bound)."""

    def __init__(self, max_users: int = 1000) -> None:
        assert max_users >= 1, max_users
        self.max_users = max_users
        self._plans: dict[str, Plan] = {}
        self._last_use: dict[str, int] = {}  # user -> tick of their last read or publish
        self._ticks = itertools.count()
        self._write = threading.Lock()  # writers only; readers never take it
        self._drop_listeners: list[Callable[[str], None]] = []

    def on_drop(self, listener: Callable[[str], None]) -> None:
        """Call `listener(user_id)` whenever the bound drops a user's plan (under the write lock: keep it to a few
        dict pops), so per-user state kept beside the book (token counts, stamps) is bounded with it."""
        self._drop_listeners.append(listener)

    def get(self, user_id: str) -> Plan:
        plan = self._plans.get(user_id)
        if plan is None:
            return Plan(user_id=user_id)
        self._last_use[user_id] = next(self._ticks)
        return plan

    def __contains__(self, user_id: str) -> bool:
        return user_id in self._plans

    def publish(self, plan: Plan) -> None:
        with self._write:
            self._plans[plan.user_id] = plan  # one atomic store; readers see the old or the new plan
            self._last_use[plan.user_id] = next(self._ticks)
            self._bound()

    def register(self, user_id: str) -> bool:
        """Hold an empty plan for a user the book does not hold (a first read, or one after the user's plan was
        dropped): True if it was added, so the caller asks for the user's plan once. A held plan is kept."""
        if user_id in self._plans:  # lock-free fast path: held users are never replaced here
            return False
        with self._write:
            if user_id in self._plans:
                return False
            self._plans[user_id] = Plan(user_id=user_id)
            self._last_use[user_id] = next(self._ticks)
            self._bound()
            return True

    def _bound(self) -> None:
        """Drop the least recently used users' plans until `max_users` remain (caller holds `_write`)."""
        while len(self._plans) > self.max_users:
            oldest = min(self._plans, key=lambda u: self._last_use.get(u, -1))
            del self._plans[oldest]
            self._last_use.pop(oldest, None)
            for listener in self._drop_listeners:
                listener(oldest)
        if len(self._last_use) > 2 * self.max_users:  # stamps a read left after its user was dropped
            for user in [u for u in list(self._last_use) if u not in self._plans]:
                self._last_use.pop(user, None)

    def users(self) -> list[str]:
        """Held users, least recently used first."""
        with self._write:
            return sorted(self._plans, key=lambda u: self._last_use.get(u, -1))

    def all(self) -> list[Plan]:
        with self._write:
            return list(self._plans.values())
