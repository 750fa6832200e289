"""The server's one plan pipeline: a `scheduler.Scheduler` built over the serving backend, and its plans as JSON.

`make_scheduler` wires the scheduler to the plaintext store and to the backend through `BackendBlockMaker`
(blocks are prefilled by the backend, in the scheduler's worker, off the request path). `plan_dict` is the
`GET /v1/memories/plan` body. Knows nothing of policy: which memories form a block is the scheduler's call.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from scheduler import Plan, Scheduler, SchedulerConfig
from serving.backends.base import Backend
from serving.config import ServingConfig

if TYPE_CHECKING:
    from kvmem.kv.blocks import BuiltBlock


class BackendBlockMaker:
    """The scheduler's `BlockMaker` over a serving backend: build, drop and warm blocks through it."""

    def __init__(self, backend: Backend):
        self.backend = backend
        find = getattr(backend, "find_block", None)  # the fake backend has none: nothing to restore
        if find is not None:  # the scheduler's optional `find_block(user_id, texts, memory_ids)`
            self.find_block = find
            self.stored_memory_ids = backend.stored_memory_ids  # restore: the blocks a user has stored
        if getattr(backend, "reload_knowledge", None) is not None:  # the scheduler's optional layout check
            self.layout_generation = self._layout_generation

    def _layout_generation(self) -> int:
        """The backend's layout generation, after it checked the installed knowledge (a stat)."""
        self.backend.reload_knowledge()
        return self.backend.knowledge_generation

    def ready(self) -> bool:
        return self.backend.is_ready()

    @property
    def serves_adapters(self) -> bool:
        """Whether the backend applies a request's LoRA adapter (else plans name none: see Backend)."""
        return bool(getattr(self.backend, "serves_adapters", False))

    @property
    def builds_under_adapter(self) -> bool:
        """Whether the backend builds a block under a user's LoRA adapter (the transformers backend does;
        without it, a user served an adapter has no block: the rest of their memories go as text)."""
        return bool(getattr(self.backend, "builds_under_adapter", False))

    def build_block(
        self, user_id: str, texts: Sequence[str], memory_ids: Sequence[str], adapter_id: str | None = None
    ) -> BuiltBlock:
        if adapter_id is not None:
            return self.backend.build_block(user_id, list(texts), list(memory_ids), adapter_id=adapter_id)
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

    def forget_adapters(self, user_id: str, adapters: Sequence[str]) -> list[str]:
        forget = getattr(self.backend, "forget_adapters", None)  # the fake backend builds under no adapter
        return forget(user_id, list(adapters)) if forget is not None else []

    def subscribe_dropped(self, callback: Callable[[str, str, str], None]) -> Callable[[], None]:
        return self.backend.subscribe_dropped(callback)


def serving_scheduler_config(config: ServingConfig) -> SchedulerConfig:
    """The scheduler settings the server runs with (`kvmem build` plans with the same)."""
    return SchedulerConfig(user_block_tokens=config.block_token_budget)


def make_scheduler(
    config: ServingConfig,
    store: Any,
    backend: Backend,
    *,
    scheduler_config: SchedulerConfig | None = None,
    clock: Callable[[], float] = time.time,
) -> Scheduler:
    """The scheduler the server runs (not started: the caller starts it). Heat persists in
    DATA_DIR/scheduler/heat.sqlite; `scheduler_config` defaults to the per-user token cap
    `config.block_token_budget`; tasks go through Redis Streams when `config.scheduler_redis_url` is set."""
    from kvmem.adapters import ActiveAdapters, AdapterRegistry
    from kvmem.adapters.active import facts_current
    from kvmem.datadir import DataDir

    def base_fingerprint() -> str | None:  # adapters trained on another model are not served
        handle = getattr(backend, "handle", None)
        return None if handle is None else handle.fingerprint.digest

    return Scheduler(
        scheduler_config or serving_scheduler_config(config),
        store,
        BackendBlockMaker(backend),
        backend.count_tokens,
        heat_path=config.data_dir / "scheduler" / "heat.sqlite",
        clock=clock,
        redis_url=config.scheduler_redis_url,
        adapters=ActiveAdapters(
            AdapterRegistry(DataDir.at(config.data_dir).adapters_dir),
            base_fingerprint,
            lambda user_id, facts: facts_current(store, user_id, facts),
        ),
    )


def plan_dict(plan: Plan) -> dict[str, Any]:
    """The `GET /v1/memories/plan` body for one plan."""
    block = plan.block
    return {
        "block": None
        if block is None
        else {
            "item_id": block.item_id,
            "memory_ids": list(block.memory_ids),
            "tokens": block.num_tokens,
            "bytes": block.num_bytes,
            "tier": "kv",
            "adapter": block.adapter,  # the served adapter name its K/V were computed under, or None
        },
        "adapter": None
        if plan.adapter is None
        else {
            "id": plan.adapter.adapter_id,
            "version": plan.adapter.version,
            "name": plan.adapter.name,
            "memory_ids": list(plan.adapter.memory_ids),  # served from it: not in the prompt
            "trained_ids": list(
                plan.adapter.trained_ids
            ),  # in its weights (those it did not fully recall too)
            "tier": "lora",
        },
        "updated_at": (
            None
            if plan.updated_at is None
            else datetime.fromtimestamp(plan.updated_at, timezone.utc).isoformat()
        ),
    }
