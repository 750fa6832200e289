"""`kvmem build` over a data dir: the blocks the server will serve, built before it serves them.

Two jobs share one loop (`attempt`: a bad input is reported and skipped, a storage failure stops the job):
- per user (`run_users`, no `--input`): the block of a user is the one the server's scheduler would choose.
  `OfflinePlanner` runs the scheduler itself (`scheduler.Scheduler`, its config from
  `scheduler.wiring.serving_scheduler_config`, as `make_scheduler` builds it) over the data dir's plaintext
  store and its persisted heat, read-only (a live server's heat is not written), and calls the worker's own
  `refresh` per user with a `BlockMaker` over a kvmem `BlockBuilder`.
- per line of a JSON-lines file (`run_build`, `--input`): each line is `{"user_id": str, "memories": [str,
  ...]}` or `{"user_id": str, "memory_ids": [str, ...]}`. A line of texts adds them to the user's store (a text
  the user already has, live and identical, is not added again: `add_missing`) and builds the block the
  planner chooses; a line of ids builds exactly those memories (resolved in the data dir's store), in that
  order. A bad line is reported with its line number and the job carries on.
A stored item that verifies is found again by its content address and not rebuilt, so a job resumes (corrupt
ones are rebuilt); the weights are loaded only when a block must be prefilled (kvmem.kv.lazy_model). The
command line is serving/ops/build_cli.py.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from kvmem.datadir import DataDir
from kvmem.errors import InvalidBlock, KVItemError, StorageError
from scheduler import BlockMaker, Scheduler
from scheduler.wiring import serving_scheduler_config
from serving.config import ServingConfig


@dataclass(frozen=True)
class BuildTask:
    line_no: int
    user_id: str
    texts: tuple[str, ...]
    memory_ids: tuple[str, ...] | None


@dataclass
class BuildReport:
    built: int = 0
    skipped: int = 0
    failed: list[tuple[int, str]] = field(default_factory=list)
    item_ids: list[str] = field(default_factory=list)
    added: int = 0  # memories the texts lines added to the store

    @property
    def ok(self) -> bool:
        return not self.failed


class BadLine(ValueError):
    pass


SKIP, STOP = object(), object()  # what `attempt` returns instead of a value


def attempt(fn, failed: list, key, label: str):
    """`fn()`, or, when it fails, the failure recorded in `failed` as (key, message) and written under `label`:
    SKIP for a bad input (InvalidBlock, KVItemError, ValueError: the job carries on), STOP for a storage
    failure (the disk is unusable: the job stops, keeping what was built). The per-line / per-user loop of
    both build jobs (per line and per user)."""
    try:
        return fn()
    except (InvalidBlock, KVItemError, ValueError) as exc:
        outcome, error = SKIP, exc
    except StorageError as exc:
        outcome, error = STOP, exc
    failed.append((key, str(error)))
    tqdm.write(f"{label}: {error}", file=sys.stderr)
    return outcome


def parse_line(line_no: int, raw: str) -> dict:
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise BadLine(f"not valid JSON ({exc.msg} at column {exc.colno})") from exc
    if not isinstance(obj, dict):
        raise BadLine("expected a JSON object")
    user = obj.get("user_id")
    if not isinstance(user, str) or not user.strip():
        raise BadLine("'user_id' must be a non-empty string")
    has_texts, has_ids = "memories" in obj, "memory_ids" in obj
    if has_texts == has_ids:
        raise BadLine("exactly one of 'memories' or 'memory_ids' is required")
    key = "memories" if has_texts else "memory_ids"
    values = obj[key]
    if (
        not isinstance(values, list)
        or not values
        or not all(isinstance(v, str) and v.strip() for v in values)
    ):
        raise BadLine(f"'{key}' must be a non-empty list of non-empty strings")
    return obj


def _resolve(obj: dict, line_no: int, store_factory) -> BuildTask:
    if "memories" in obj:
        return BuildTask(line_no, obj["user_id"], tuple(obj["memories"]), None)
    store = store_factory()
    found = {m.id: m for m in store.memories_by_ids(obj["user_id"], obj["memory_ids"])}
    missing = [i for i in obj["memory_ids"] if i not in found]
    if missing:
        raise BadLine(f"memory ids not found for user {obj['user_id']!r}: {missing[:5]}")
    ids = tuple(obj["memory_ids"])
    return BuildTask(line_no, obj["user_id"], tuple(found[i].text for i in ids), ids)


def _build_line(line_no: int, raw: str, builder, planner, store_factory, report: BuildReport):
    """The line's block (a line of texts adds them first, counted in `report.added`)."""
    task = _resolve(parse_line(line_no, raw), line_no, store_factory)
    if task.memory_ids is not None:
        return builder.build(task.user_id, task.texts, task.memory_ids, verify_existing=True)
    report.added += planner.add_missing(task.user_id, task.texts)
    block = planner.plan(task.user_id)
    if block.item_id is None:
        raise BadLine(f"the scheduler's policy serves no block for user {task.user_id!r}")
    return block


def run_build(
    input_path: str | Path, builder, *, data_dir: DataDir, planner=None, progress: bool = True
) -> BuildReport:
    """Build every line's block with `builder` (a kvmem.kv.blocks.BlockBuilder); lines of texts go through
    `planner` (`add_missing(user, texts)`, `plan(user)` -> `.item_id`, `.built`; its `.store`)."""
    report = BuildReport()

    def store_factory():
        return planner.store

    lines = Path(input_path).read_text().splitlines()
    bar = tqdm(total=len(lines), desc="kvmem build", unit="block", disable=not progress, file=sys.stderr)
    for line_no, raw in enumerate(lines, start=1):
        bar.update(1)
        if not raw.strip():
            continue
        block = attempt(
            lambda line_no=line_no, raw=raw: _build_line(
                line_no, raw, builder, planner, store_factory, report
            ),
            report.failed,
            line_no,
            f"line {line_no}",
        )
        if block is STOP:
            break
        if block is SKIP:
            continue
        report.item_ids.append(block.item_id)
        if block.built:
            report.built += 1
        else:
            report.skipped += 1
        bar.set_postfix(built=report.built, skipped=report.skipped, failed=len(report.failed))
    bar.close()
    return report


class OfflineBlockMaker(BlockMaker):
    """The scheduler's BlockMaker over a kvmem BlockBuilder (no serving backend, no model loop); its blocks
    are files under the data dir, found again by `find_block`."""

    finds_stored_blocks = True

    def __init__(self, builder: Any):
        self.builder = builder

    def ready(self) -> bool:
        return True

    def kv_bytes_per_token(self) -> int:
        """The model's (loads it: asked only when a byte quota sizes a block, i.e. before a build)."""
        return self.builder.handle.kv_bytes_per_token

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
    """Every memory of the user's that is not deleted: active, archived or superseded."""
    out, page = [], 1
    while True:
        chunk = store.list(user_id, page=page, page_size=500, state="all", include_superseded=True)
        out.extend(chunk.items)
        if len(out) >= chunk.total or not chunk.items:
            return out
        page += 1


def add_missing(store: Any, user_id: str, texts: Sequence[str]) -> int:
    """Add the texts the user does not have yet (identity: the exact text, per user; a text given twice is
    one memory). One the user archived, or a newer memory superseded, counts as had: a rerun of the same input
    never brings it back. Returns how many were added."""
    have = {m.text for m in live_memories(store, user_id)}
    new = [t for t in dict.fromkeys(texts) if t not in have]
    if new:
        store.add(user_id, texts=new)
    return len(new)


class OfflinePlanner:
    """Owns the memory store it opens and the scheduler it builds; `close()` them."""

    def __init__(
        self,
        data_dir: DataDir,
        builder: Any,
        *,
        block_token_budget: int = 2048,
        kv_user_mb: int | None = None,
        store: str | None = None,
    ):
        """`store`: as `kvmem serve --store` (a postgresql:// URL: heat is read from it too); None: the data
        dir's SQLite file."""
        from kvmem.kv.layout import memory_line
        from kvmem.text import MemoryStore, TextStoreConfig

        serving = ServingConfig(
            data_dir=data_dir.root, block_token_budget=block_token_budget, kv_user_mb=kv_user_mb, store=store
        )
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
