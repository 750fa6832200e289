"""`BlockMaker`: what the scheduler builds, finds, warms and drops KV blocks through, declared once.

Serving subclasses it over its backend (wiring.BackendBlockMaker), `kvmem build` over a kvmem BlockBuilder,
tests and the simulator with fakes. Building and dropping are required; everything else has a default that
means "this builder cannot" (stores nothing of its own, restores nothing, never switches layout), so the
scheduler calls methods and never asks by name what a builder has. Knows nothing of policy or plans.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvmem.kv.blocks import BuiltBlock


class BuildsStopped(RuntimeError):
    """`build_block` called after `cancel_builds` (the scheduler is shutting down)."""


class BlockMaker(ABC):
    """One level above kvmem's `BlockBuilder` (which is behind a backend in serving). Every method may be
    called from the scheduler's worker thread; `ready`, `has_block` also from request threads."""

    # whether stored blocks outlive the process and `find_block` finds them again (a restart, `kvmem build`,
    # a peer replica's data dir): the scheduler restores plans (publishes a stored block without a prefill)
    # only over such a builder, and serving waits for that restore at start only then
    finds_stored_blocks: bool = False
    # whether the backend applies a request's LoRA adapter (else plans name none)
    serves_adapters: bool = True
    # whether `build_block(..., adapter_id=...)` computes a block under a user's adapter (else a user served
    # an adapter has no block: the rest of their memories go as text)
    builds_under_adapter: bool = False

    def kv_bytes_per_token(self) -> int | None:
        """What a block holds per token (K and V, every layer) once the model is loaded; None: not known (the
        scheduler then sizes a byte-capped block by SchedulerConfig.bytes_per_token until a build tells it)."""
        return None

    @abstractmethod
    def ready(self) -> bool:
        """Whether blocks can be built (and found) now; the worker defers refreshes until then."""

    @abstractmethod
    def build_block(
        self, user_id: str, texts: Sequence[str], memory_ids: Sequence[str], adapter_id: str | None = None
    ) -> BuiltBlock:
        """Prefill and store the block of `texts` (parallel to `memory_ids`); `adapter_id` is passed only with
        `builds_under_adapter`. Content-addressed: a block already stored is returned, not built again."""

    @abstractmethod
    def drop_block(self, item_id: str) -> None:
        """Stop serving `item_id` and free it; unknown ids are ignored."""

    def find_block(self, user_id: str, texts: Sequence[str], memory_ids: Sequence[str]) -> BuiltBlock | None:
        """The stored, valid block of these memories, or None; never prefills. Called only with
        `finds_stored_blocks`. Default: none stored."""
        return None

    def stored_memory_ids(self, user_id: str) -> list[tuple[str, ...]]:
        """The memory ids of the user's stored blocks, newest first (a user new to this process is given the
        newest the policy keeps, found by `find_block`). Default: none."""
        return []

    def warm_block(self, item_id: str) -> None:
        """Move a stored block to the fastest tier (a session started). Default: nothing to move."""
        return None

    def cut_block(self, item_id: str, memory_ids: Sequence[str], texts: Sequence[str]) -> BuiltBlock | None:
        """Store the block of the first memories of the stored block `item_id` (`memory_ids`, a proper prefix
        of its own, with their `texts`) from its K/V, with no prefill, and return it; None when it cannot be
        cut. Called on the store's thread before a block whose later memory changed is deleted: the memories
        before the change stay served from KV, and the rebuild prefills only the rest. Default: cannot."""
        return None

    def cancel_builds(self) -> None:
        """Shutting down: a `build_block` under way ends soon by raising (nothing stored; a restart rebuilds
        what it needs), and so does any called after this. Default: builds cannot be cancelled."""
        return None

    def has_block(self, item_id: str) -> bool:
        """Whether `item_id` is still stored (checked before a block is published and served). Default: a
        builder that reports no drops keeps every block it built until `drop_block`."""
        return True

    def forget(self, user_id: str, memory_ids: Sequence[str] | None) -> list[str]:
        """The delete cascade: drop every stored block of `user_id` built from any of `memory_ids` (None: all
        of theirs) before returning; their ids. Default: nothing stored beyond the published blocks."""
        return []

    def forget_adapters(self, user_id: str, adapters: Sequence[str]) -> list[str]:
        """The cascade for erased LoRA adapter versions: drop every stored block built under one of them;
        their ids. Default: no block is built under an adapter."""
        return []

    def subscribe_dropped(self, callback: Callable[[str, str, str], None]) -> Callable[[], None]:
        """Call `callback(item_id, user_id, reason)` when the store drops a block on its own; returns an
        unsubscribe. Default: it never does."""
        return lambda: None

    def layout_generation(self) -> int:
        """The builder's prompt layout generation (e.g. the deployment's shared knowledge); a change makes the
        scheduler retract every published block. Default: 0, never changes."""
        return 0
