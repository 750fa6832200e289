"""The scheduler as serving's plan provider: its plans in serving's `Plan` shape, access events forwarded.

Also the adapter that lets the scheduler build blocks through the serving backend. Knows nothing of policy.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from scheduler import AccessEvent as SchedAccessEvent
from scheduler import Scheduler, SchedulerConfig
from serving.backends.base import Backend, BlockInfo
from serving.plans import AccessEvent, Plan, PlanProvider


class BackendBlockBuilder:
    """Builds and drops blocks through the backend (prefill in the scheduler's worker thread)."""

    def __init__(self, backend: Backend):
        self.backend = backend

    def ready(self) -> bool:
        return self.backend.is_ready()

    def build_block(self, user_id: str, texts: Sequence[str], memory_ids: Sequence[str]) -> BlockInfo:
        return self.backend.build_block(user_id, list(texts), list(memory_ids))

    def drop_block(self, item_id: str) -> None:
        self.backend.drop_block(item_id)

    def warm_block(self, item_id: str) -> None:
        warm = getattr(self.backend, "warm_block", None)
        if warm is not None:
            warm(item_id)

    def has_block(self, item_id: str) -> bool:
        return self.backend.has_block(item_id)

    def forget(self, user_id: str, memory_ids: Sequence[str] | None) -> list[str]:
        return self.backend.forget(user_id, memory_ids)

    def subscribe_dropped(self, callback: Callable[[str, str, str], None]) -> Callable[[], None]:
        return self.backend.subscribe_dropped(callback)


class SchedulerPlanProvider(PlanProvider):
    def __init__(
        self,
        store: Any,
        backend: Backend,
        *,
        token_budget: int,
        data_dir: Path | None = None,
        config: SchedulerConfig | None = None,
        redis_url: str | None = None,
        start: bool = True,
    ):
        self.backend = backend
        config = config or SchedulerConfig(user_block_tokens=token_budget)
        heat_path = None if data_dir is None else Path(data_dir) / "scheduler" / "heat.sqlite"
        self.scheduler = Scheduler(
            config,
            store,
            BackendBlockBuilder(backend),
            self._count_tokens,
            heat_path=heat_path,
            redis_url=redis_url,
        )
        if start:
            self.scheduler.start()

    def _count_tokens(self, text: str) -> int:
        return self.backend.count_tokens(text)

    def get(self, user_id: str) -> Plan:
        plan = self.scheduler.get(user_id)
        updated = None if plan.updated_at is None else datetime.fromtimestamp(plan.updated_at, timezone.utc)
        if plan.block is None:
            return Plan(user_id=user_id, adapter_id=plan.adapter_id, updated_at=updated)
        b = plan.block
        return Plan(
            user_id=user_id,
            block_item_id=b.item_id,
            block_memory_ids=b.memory_ids,
            block_texts=b.texts,
            block_tokens=b.num_tokens,
            block_bytes=b.num_bytes,
            block_token_ids=b.token_ids,
            adapter_id=plan.adapter_id,
            updated_at=updated,
        )

    def record_access(self, event: AccessEvent) -> None:
        self.scheduler.record_access(
            SchedAccessEvent(
                event.user_id,
                tuple(event.retrieved_ids),
                tuple(event.used_ids),
                event.at.timestamp(),
                event.session_id,
            )
        )

    def session_start(self, user_id: str) -> None:
        self.scheduler.session_start(user_id)

    def report_unservable(self, user_id: str, item_id: str) -> None:
        self.scheduler.report_unservable(user_id, item_id)

    def forget_user(self, user_id: str) -> None:
        self.scheduler.forget_user(user_id)

    def flush(self, timeout_s: float = 60.0) -> None:
        """Wait until the worker has drained its queue (tests)."""
        deadline = time.monotonic() + timeout_s
        while not self.scheduler.idle() and time.monotonic() < deadline:
            time.sleep(0.02)

    def close(self) -> None:
        self.scheduler.stop()
