"""`kvmem build`: the offline KV cache build job over a JSON-lines file.

Each line is `{"user_id": str, "memories": [str, ...]}` or `{"user_id": str, "memory_ids": [str, ...]}`.
A line of texts adds them to the user's plaintext store (a text the user already has is not added again)
and builds the block the server will serve for the user (the `planner`: serving.offline_build). A line of
ids builds exactly those memories (resolved in the data dir's store), in that order. Resumable: valid items
are skipped, corrupt ones rebuilt. A bad line is reported with its line number and the job carries on; the
exit code is 1 if any line failed.
"""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from kvmem.datadir import DataDir
from kvmem.errors import InvalidBlock, KVItemError, StorageError

log = logging.getLogger(__name__)


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
    both build jobs (this one and serving.offline_build)."""
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
