"""Plans: immutable snapshots of what is accelerated for each user, swapped atomically.

`PlanBook.get` never blocks and never raises: readers take whatever snapshot is current (a dict read), an
unknown user gets an empty plan. Knows nothing of heat or how blocks are built.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass


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


@dataclass(frozen=True)
class Plan:
    user_id: str
    block: BlockPlan | None = None
    adapter_id: str | None = None
    version: int = 0
    updated_at: float | None = None

    @property
    def covered_ids(self) -> frozenset[str]:
        return frozenset(self.block.memory_ids) if self.block else frozenset()


class PlanBook:
    def __init__(self) -> None:
        self._plans: dict[str, Plan] = {}
        self._write = threading.Lock()  # writers only; readers never take it

    def get(self, user_id: str) -> Plan:
        return self._plans.get(user_id) or Plan(user_id=user_id)

    def publish(self, plan: Plan) -> None:
        with self._write:
            self._plans[plan.user_id] = plan  # one atomic store; readers see the old or the new plan

    def users(self) -> list[str]:
        return sorted(self._plans)

    def all(self) -> list[Plan]:
        return list(self._plans.values())
