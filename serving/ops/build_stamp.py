"""`kvmem build`'s fast path: what the last complete build over a data dir depended on, and whether any of it
changed since.

A build of every user's block depends on the build's own settings, each user's memories (the plaintext store's
per-user generation, which moves with every add, change and delete), the persisted heat the scheduler's policy
reads, the installed shared knowledge and the stored KV items (a file removed, replaced or corrupted since).
When none of that changed, the previous build's blocks are still the ones the policy would choose and they are
still on disk as they were verified: there is nothing to build, and the command says so without loading torch,
the tokenizer or the model, and without hashing the items again. Reads only SQLite tables and file stats.
Knows nothing of how blocks are chosen or built.
"""

from __future__ import annotations

import json
import os
import sqlite3
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from kvmem.datadir import DataDir

STAMP_VERSION = 1


def stamp_path(data_dir: DataDir) -> Path:
    return data_dir.root / "build" / "last_build.json"


def _file_sig(path: Path) -> list[int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return [st.st_size, st.st_mtime_ns, st.st_ino]


def _wal_sig(path: Path) -> list[int] | None:
    """A SQLite WAL's signature; an empty one is none (a read-only reader may leave one behind)."""
    sig = _file_sig(path)
    return None if sig is None or sig[0] == 0 else sig


def _tree_sig(root: Path) -> dict[str, list[int]]:
    """Every file under `root` (relative path -> size, mtime, inode); temporary names included."""
    out: dict[str, list[int]] = {}
    if not root.is_dir():
        return out
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            path = Path(dirpath) / name
            sig = _file_sig(path)
            if sig is not None:
                out[str(path.relative_to(root))] = sig
    return out


def _generations(text_db: Path) -> dict[str, int] | None:
    """Each user's store generation (MemoryStore.generation), read without opening the store."""
    if not text_db.is_file():
        return None
    conn = sqlite3.connect(f"file:{text_db.resolve()}?mode=ro", uri=True)
    try:
        return {user: int(gen) for user, gen in conn.execute("SELECT user_id, gen FROM user_generation")}
    except sqlite3.Error:
        return None  # an older or foreign file: no fast path
    finally:
        conn.close()


def inputs(data_dir: DataDir, settings: dict[str, Any]) -> dict[str, Any] | None:
    """What a build of every user's block depends on, read before it runs (None: cannot tell: build)."""
    generations = _generations(data_dir.text_db)
    if generations is None:
        return None
    heat = data_dir.scheduler_dir / "heat.sqlite"
    return {
        "settings": settings,
        "generations": generations,
        "heat": [_file_sig(heat), _wal_sig(heat.with_name(f"{heat.name}-wal"))],
        "knowledge": _tree_sig(data_dir.root / "knowledge"),
    }


def unchanged_since_last(data_dir: DataDir, settings: dict[str, Any]) -> dict[str, Any] | None:
    """The last build's stamp if nothing it depended on changed since (the fast path), else None."""
    try:
        last = json.loads(stamp_path(data_dir).read_text())
    except (OSError, ValueError):
        return None
    now = inputs(data_dir, settings)
    if not isinstance(last, dict) or last.get("version") != STAMP_VERSION or now is None:
        return None
    if last.get("inputs") != json.loads(json.dumps(now)) or last.get("items") != _tree_sig(data_dir.kv_dir):
        return None
    return last


def record(data_dir: DataDir, before: dict[str, Any], num_users: int) -> None:
    """After a complete build: what it depended on (`before`, read before it ran: a change made while it ran
    makes the next build check again) and the KV items as they are now, verified."""
    path = stamp_path(data_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {
        "version": STAMP_VERSION,
        "finished_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "num_users": num_users,
        "inputs": before,
        "items": _tree_sig(data_dir.kv_dir),
    }
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(body, sort_keys=True))
    os.replace(tmp, path)


def forget(data_dir: DataDir) -> None:
    """No fast path next time (a build that failed, or changed what the stamp does not cover)."""
    try:
        stamp_path(data_dir).unlink()
    except FileNotFoundError:
        pass
