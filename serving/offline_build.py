"""`kvmem build` over a data dir: the blocks the server will serve, built before it serves them.

The block of a user is the one the server's scheduler would choose: `OfflinePlanner` runs the scheduler itself
(`scheduler.Scheduler`, its config from `scheduler.wiring.serving_scheduler_config`, as `make_scheduler` builds it) over
the data dir's plaintext store and its persisted heat, read-only (a live server's heat is not written), and
calls the worker's own `refresh` per user with a `BlockMaker` over a kvmem `BlockBuilder`. A stored item that
verifies is found again by its content address and not rebuilt, so a job resumes; the weights are loaded only
when a block must be prefilled (kvmem.kv.lazy_model). Raw-text lines add their memories to the user's store
first (`add_missing`): a text the user already has, live and identical, is not added again.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tqdm import tqdm

from kvmem.datadir import DataDir
from kvmem.kv.build_job import SKIP, STOP, attempt
from scheduler import Scheduler
from scheduler.wiring import serving_scheduler_config
from serving.config import ServingConfig


class OfflineBlockMaker:
    """The scheduler's BlockMaker over a kvmem BlockBuilder (no serving backend, no model loop)."""

    def __init__(self, builder: Any):
        self.builder = builder

    def ready(self) -> bool:
        return True

    def build_block(self, user_id: str, texts: Sequence[str], memory_ids: Sequence[str]) -> Any:
        return self.builder.build(user_id, list(texts), list(memory_ids), verify_existing=True)

    def find_block(self, user_id: str, texts: Sequence[str], memory_ids: Sequence[str]) -> Any:
        return self.builder.find(user_id, list(texts), list(memory_ids), verify=True)

    def drop_block(self, item_id: str) -> None:
        self.builder.store.remove(item_id)


@dataclass(frozen=True)
class Planned:
    item_id: str | None  # None: the policy chooses no block for the user (nothing hot enough, or no memories)
    built: bool  # prefilled now (False: found stored and valid, or no block)


def live_memories(store: Any, user_id: str) -> list[Any]:
    out, page = [], 1
    while True:
        chunk = store.list(user_id, page=page, page_size=500)
        out.extend(chunk.items)
        if len(out) >= chunk.total or not chunk.items:
            return out
        page += 1


def add_missing(store: Any, user_id: str, texts: Sequence[str]) -> int:
    """Add the texts the user does not have yet (identity: the exact text, per user; a text given twice is
    one memory). Returns how many were added."""
    have = {m.text for m in live_memories(store, user_id)}
    new = [t for t in dict.fromkeys(texts) if t not in have]
    if new:
        store.add(user_id, texts=new)
    return len(new)


class OfflinePlanner:
    """Owns the memory store it opens and the scheduler it builds; `close()` them."""

    def __init__(self, data_dir: DataDir, builder: Any, *, block_token_budget: int = 2048):
        from kvmem.kv.layout import memory_line
        from kvmem.text import MemoryStore, TextStoreConfig

        serving = ServingConfig(data_dir=data_dir.root, block_token_budget=block_token_budget)
        longest = max(serving.limits.max_memory_text_chars, serving.limits.max_message_chars)
        self.store = MemoryStore(serving.store_path, config=TextStoreConfig(max_text_chars=longest))
        tokenizer = builder.handle.tokenizer

        def count_tokens(text: str) -> int:  # as the serving backend counts (StoredBlocksBackend)
            return len(tokenizer(memory_line(text), add_special_tokens=False)["input_ids"])

        self.scheduler = Scheduler(
            serving_scheduler_config(serving),
            self.store,
            OfflineBlockMaker(builder),
            count_tokens,
            heat_path=data_dir.scheduler_dir / "heat.sqlite",
            heat_read_only=True,
        )

    def add_missing(self, user_id: str, texts: Sequence[str]) -> int:
        return add_missing(self.store, user_id, texts)

    def plan(self, user_id: str) -> Planned:
        """Build (or find) the user's block as the server's scheduler would choose it now."""
        counts = self.scheduler.worker.counts
        before = counts["prefills"]
        plan = self.scheduler.worker.refresh(user_id)
        block = plan.block
        return Planned(None if block is None else block.item_id, counts["prefills"] > before)

    def close(self) -> None:
        self.scheduler.heat.close()
        self.store.close()


@dataclass
class UsersReport:
    built: int = 0
    skipped: int = 0
    no_block: int = 0
    failed: list[tuple[str, str]] | None = None

    def __post_init__(self) -> None:
        self.failed = [] if self.failed is None else self.failed


def run_users(planner: OfflinePlanner, users: Sequence[str] | None, *, progress: bool = True) -> UsersReport:
    """Build every user's planned block (default: every user with memories). A user without memories, or
    whose block cannot be built, is reported and skipped; a storage failure stops the job."""
    report = UsersReport()
    known = planner.store.count_by_user()
    todo = list(users) if users is not None else sorted(known)
    bar = tqdm(todo, desc="kvmem build", unit="user", disable=not progress, file=sys.stderr)
    for user_id in bar:
        if not known.get(user_id):
            report.failed.append((user_id, "the user has no memories in this data dir"))
            tqdm.write(f"user {user_id!r}: the user has no memories in this data dir", file=sys.stderr)
            continue
        planned = attempt(lambda u=user_id: planner.plan(u), report.failed, user_id, f"user {user_id!r}")
        if planned is STOP:
            break
        if planned is SKIP:
            continue
        if planned.item_id is None:
            report.no_block += 1
        elif planned.built:
            report.built += 1
        else:
            report.skipped += 1
        bar.set_postfix(built=report.built, skipped=report.skipped, failed=len(report.failed))
    bar.close()
    return report
