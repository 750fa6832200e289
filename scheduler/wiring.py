"""The server's one plan pipeline: a `Scheduler` built over a serving backend and the plaintext store.

`make_scheduler` wires the scheduler to the store and to the backend through `BackendBlockMaker` (blocks are
prefilled by the backend, in the scheduler's worker, off the request path). The backend and the server's
settings are taken by what they provide (`ServerSettings`, `BlockBackend`: protocols of the scheduler's own,
which serving's ServingConfig and Backend satisfy), so this module imports nothing of serving, not even for
type checking (the packages depend kvmem <- scheduler <- serving). Knows nothing of policy: which memories form a block is the
scheduler's call; nor of HTTP (the plan's JSON body is serving.http.protocol.plan_dict).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from scheduler.block_maker import BlockMaker, BuildsStopped
from scheduler.config import SchedulerConfig
from scheduler.guard import Fence
from scheduler.service import Scheduler

if TYPE_CHECKING:
    from kvmem.kv.blocks import BuiltBlock


class ServerSettings(Protocol):
    """What the wiring reads of the server's settings (serving.config.ServingConfig provides it)."""

    data_dir: Path
    block_token_budget: int
    kv_user_mb: int | None  # one user's KV quota (`--kv-user-mb`): their block is built within it too
    scheduler_redis_url: str | None


class BlockBackend(Protocol):
    """What the scheduler uses of a serving backend (serving.backends.base.Backend provides all of it)."""

    finds_stored_blocks: bool
    knowledge_generation: int
    serves_adapters: bool
    builds_under_adapter: bool

    def reload_knowledge(self) -> None: ...
    def kv_bytes_per_token(self) -> int | None: ...
    def use_kv_heat(self, heat: Callable[[str], float]) -> None: ...
    def is_ready(self) -> bool: ...
    def build_block(
        self, user_id: str, block_texts: Sequence[str], memory_ids=None, adapter_id=None
    ) -> Any: ...
    def drop_block(self, item_id: str) -> None: ...
    def cancel_builds(self) -> int: ...
    def find_block(self, user_id: str, texts: Sequence[str], memory_ids: Sequence[str]) -> Any: ...
    def stored_memory_ids(self, user_id: str) -> list: ...
    def warm_block(self, item_id: str) -> None: ...
    def has_block(self, item_id: str) -> bool: ...
    def forget(self, user_id: str, memory_ids: Sequence[str] | None = None) -> list[str]: ...
    def forget_adapters(self, user_id: str, adapters: Sequence[str]) -> list[str]: ...
    def subscribe_dropped(self, callback: Callable[..., None]) -> Callable[[], None]: ...
    def count_tokens(self, text: str) -> int: ...
    def fingerprint_digest(self) -> str | None: ...


class BackendBlockMaker(BlockMaker):
    """The scheduler's `BlockMaker` over a serving backend: build, drop and warm blocks through it. Every
    backend method it calls is on the Backend interface (optional ones with a default there)."""

    def __init__(self, backend: BlockBackend):
        self.backend = backend
        # the scheduler restores plans only over a backend whose blocks outlive it (the fake stores nothing)
        self.finds_stored_blocks = backend.finds_stored_blocks
        self._cancelled = False  # cancel_builds: no build starts after it

    def layout_generation(self) -> int:
        """The backend's layout generation, after it checked the installed knowledge (a stat)."""
        self.backend.reload_knowledge()
        return self.backend.knowledge_generation

    def ready(self) -> bool:
        return self.backend.is_ready()

    def kv_bytes_per_token(self) -> int | None:
        """What the backend's blocks hold per token, once it is loaded (None before, or without KV)."""
        return self.backend.kv_bytes_per_token()

    @property
    def serves_adapters(self) -> bool:
        """Whether the backend applies a request's LoRA adapter (else plans name none: see Backend)."""
        return self.backend.serves_adapters

    @property
    def builds_under_adapter(self) -> bool:
        """Whether the backend builds a block under a user's LoRA adapter (the transformers backend does;
        without it, a user served an adapter has no block: the rest of their memories go as text)."""
        return self.backend.builds_under_adapter

    def build_block(
        self, user_id: str, texts: Sequence[str], memory_ids: Sequence[str], adapter_id: str | None = None
    ) -> BuiltBlock:
        if self._cancelled:
            raise BuildsStopped(f"not building the block of user {user_id!r}: the scheduler is shutting down")
        if adapter_id is not None:
            return self.backend.build_block(user_id, list(texts), list(memory_ids), adapter_id=adapter_id)
        return self.backend.build_block(user_id, list(texts), list(memory_ids))

    def drop_block(self, item_id: str) -> None:
        self.backend.drop_block(item_id)

    def cut_block(self, item_id: str, memory_ids: Sequence[str], texts: Sequence[str]) -> BuiltBlock | None:
        return self.backend.cut_block(item_id, list(memory_ids), list(texts))

    def cancel_builds(self) -> None:
        """The backend cancels its builds in flight (those of other schedulers over it too: it is shutting
        down with this one); this maker starts no more."""
        self._cancelled = True
        if self.backend.cancel_builds():
            logging.getLogger(__name__).info("shutting down: block builds in flight cancelled")

    def find_block(self, user_id: str, texts: Sequence[str], memory_ids: Sequence[str]) -> BuiltBlock | None:
        return self.backend.find_block(user_id, texts, memory_ids)

    def stored_memory_ids(self, user_id: str) -> list[tuple[str, ...]]:
        """The blocks a user has stored (none over a backend that does not find stored blocks)."""
        return self.backend.stored_memory_ids(user_id) if self.finds_stored_blocks else []

    def warm_block(self, item_id: str) -> None:
        self.backend.warm_block(item_id)

    def has_block(self, item_id: str) -> bool:
        return self.backend.has_block(item_id)

    def forget(self, user_id: str, memory_ids: Sequence[str] | None) -> list[str]:
        return self.backend.forget(user_id, memory_ids)

    def forget_adapters(self, user_id: str, adapters: Sequence[str]) -> list[str]:
        return self.backend.forget_adapters(user_id, list(adapters))

    def subscribe_dropped(self, callback: Callable[[str, str, str], None]) -> Callable[[], None]:
        return self.backend.subscribe_dropped(callback)


def serving_scheduler_config(config: ServerSettings) -> SchedulerConfig:
    """The scheduler settings the server runs with (`kvmem build` plans with the same): a user's block holds at
    most `block_token_budget` memory tokens and, under `--kv-user-mb`, no more bytes than the user's quota (so it
    fits the quota in every tier: the pool's pages, host RAM and disk)."""
    quota = None if config.kv_user_mb is None else config.kv_user_mb << 20
    return SchedulerConfig(user_block_tokens=config.block_token_budget, user_block_bytes=quota)


def make_scheduler(
    config: ServerSettings,
    store: Any,
    backend: BlockBackend,
    *,
    scheduler_config: SchedulerConfig | None = None,
    clock: Callable[[], float] = time.time,
    fence: Fence | None = None,
) -> Scheduler:
    """The scheduler the server runs (not started: the caller starts it). Heat persists in
    DATA_DIR/scheduler/heat.sqlite; `scheduler_config` defaults to the per-user token cap
    `config.block_token_budget`; tasks go through Redis Streams when `config.scheduler_redis_url` is set, and
    so does the shared fence unless `fence` is given (tests: an in-memory one)."""
    from kvmem.adapters import ActiveAdapters, AdapterRegistry
    from kvmem.adapters.active import facts_current
    from kvmem.datadir import DataDir

    scheduler = Scheduler(
        scheduler_config or serving_scheduler_config(config),
        store,
        BackendBlockMaker(backend),
        backend.count_tokens,
        heat_path=config.data_dir / "scheduler" / "heat.sqlite",
        clock=clock,
        redis_url=config.scheduler_redis_url,
        # a stream per replica: a user's plan must be built in the replica that serves them (the router keeps
        # a user on one replica; a shared stream would hand their refresh to any process)
        redis_stream=f"kvmem:scheduler:{config.replica}",
        fence=fence,
        adapters=ActiveAdapters(
            AdapterRegistry(DataDir.at(config.data_dir).adapters_dir),
            backend.fingerprint_digest,  # adapters trained on another model are not served
            lambda user_id, facts: facts_current(store, user_id, facts),
        ),
    )
    # the engine's eviction by expected reuse (--kv-evict-policy heat); a backend without a page pool ignores it
    backend.use_kv_heat(lambda user_id: user_heat(scheduler, user_id, clock()))
    return scheduler


def user_heat(scheduler: Scheduler, user_id: str, now: float) -> float:
    """A user's expected reuse: the decayed heat of their memories, summed (0 for a user with none)."""
    heat = scheduler.heat
    return sum(s.score_now(now, heat.half_life_s) for s in heat.stats(user_id).values())
