"""Exporting a store to a JSON-lines dump and importing one back, each in one transaction.

Owns reading a consistent snapshot out line by line, and loading a whole dump all or nothing (vectors reused
when they came from the same embedder). Dumps hold memories (superseded ones and their supersession and
provenance fields included), not the conversation log: a turn is not exported, so an imported memory's
source_turn_ids may name turns the new file lacks. The line format is dump.py's; argument checks are the
store's. Knows nothing of search.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Callable
from typing import IO

import numpy as np

from kvmem.text.db.connections import Database
from kvmem.text.db.rows import (
    COLUMNS,
    LIVE,
    NUM_COLUMNS,
    bump_generation,
    existing_ids,
    insert_history,
    insert_memory,
    read_versions,
    row_to_memory,
)
from kvmem.text.dump import DumpRecord, decode_line, encode_line
from kvmem.text.errors import InvalidMemoryInput
from kvmem.text.records import ChangeEvent, Memory
from kvmem.text.search.embedders import Embedder
from kvmem.text.search.vectors import VectorCache

ON_CONFLICT = ("error", "skip")


def export_jsonl(
    db: Database, embedder_name: str, fp_or_path: str | os.PathLike | IO[str], user_id: str | None = None
) -> int:
    """Writes live memories (one user's, or all) as JSON lines with history and vectors; returns how many."""
    if isinstance(fp_or_path, (str, os.PathLike)):
        with open(fp_or_path, "w", encoding="utf-8") as fp:
            return export_jsonl(db, embedder_name, fp, user_id)
    where, params = (f"{LIVE} AND m.user_id = ?", [user_id]) if user_id is not None else (LIVE, [])
    count = 0
    with db.snapshot() as conn:
        cursor = conn.execute(
            f"SELECT m.rowid, {COLUMNS}, v.vec FROM memories m LEFT JOIN memory_vectors v "
            f"ON v.rowid = m.rowid WHERE {where} ORDER BY m.rowid",
            params,
        )
        for row in cursor:
            memory = row_to_memory(row[1 : 1 + NUM_COLUMNS])
            history = read_versions(conn, row[0]) if memory.version > 1 else []
            fp_or_path.write(encode_line(memory, history, embedder_name, row[1 + NUM_COLUMNS]) + "\n")
            count += 1
    return count


def import_jsonl(
    db: Database,
    embedder: Embedder,
    vectors: VectorCache,
    fp_or_path: str | os.PathLike | IO[str],
    *,
    embed_batch_size: int,
    progress: bool = False,
    on_conflict: str = "error",
    insert: Callable[[sqlite3.Connection, Memory, bytes], int] = insert_memory,
) -> int:
    """Loads a dump in one transaction (all or nothing); returns how many memories were added. Rows go
    through `insert` (the store's, so a failing insert can be tested the same way for add and import).

    Every line is decoded and every missing vector computed before the write lock is taken, so embedding a
    large dump does not hold up other writers. An id already in the file is an InvalidMemoryInput
    (on_conflict='error') or left alone (on_conflict='skip').
    """
    assert on_conflict in ON_CONFLICT, on_conflict
    if isinstance(fp_or_path, (str, os.PathLike)):
        with open(fp_or_path, encoding="utf-8") as fp:
            return import_jsonl(
                db,
                embedder,
                vectors,
                fp,
                embed_batch_size=embed_batch_size,
                progress=progress,
                on_conflict=on_conflict,
                insert=insert,
            )
    from tqdm import tqdm

    records: list[DumpRecord] = []
    line_of: dict[str, int] = {}  # id -> its line
    seen: set[str] = set()
    lines = tqdm(fp_or_path, desc="read", unit=" lines", disable=not progress)
    for line_no, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        record = decode_line(line, line_no)
        if record.memory.id in seen:
            raise InvalidMemoryInput(f"line {line_no}: id {record.memory.id!r} appears twice in the dump")
        seen.add(record.memory.id)
        line_of[record.memory.id] = line_no
        records.append(record)
    record_vectors = import_vectors(records, embedder, embed_batch_size, progress)
    with db.write() as tx:
        existing = existing_ids(tx.conn, [r.memory.id for r in records])
        if existing and on_conflict == "error":
            raise InvalidMemoryInput(f"{len(existing)} id(s) already in the store, e.g. {min(existing)!r}")
        users: set[str] = set()
        for record, vector in tqdm(
            list(zip(records, record_vectors, strict=False)),
            desc="import",
            unit=" memories",
            disable=not progress,
        ):
            memory = record.memory
            if memory.id in existing:
                continue
            try:
                rowid = insert(tx.conn, memory, vector.tobytes())
                insert_history(tx.conn, rowid, record.history)
            except InvalidMemoryInput as exc:  # what only the database refuses (a NUL on PostgreSQL)
                raise InvalidMemoryInput(f"line {line_of[memory.id]}: {exc}") from None
            users.add(memory.user_id)
            tx.events.append(ChangeEvent(memory.id, memory.user_id, "added"))
        for user in sorted(users):
            bump_generation(tx.conn, user)
        tx.after_commit.extend((lambda u=user: vectors.invalidate(u)) for user in users)
    return len(tx.events)


def import_vectors(
    records: list[DumpRecord], embedder: Embedder, batch_size: int, progress: bool
) -> list[np.ndarray]:
    """Each record's vector: its own if it came from this embedder, else embedded now in batches."""
    from tqdm import tqdm

    out: list[np.ndarray | None] = [
        r.vector
        if r.embedder_name == embedder.name and r.vector is not None and r.vector.shape == (embedder.dim,)
        else None
        for r in records
    ]
    todo = [i for i, v in enumerate(out) if v is None]
    for start in tqdm(
        range(0, len(todo), batch_size), desc="embed", unit=" batches", disable=not progress or not todo
    ):
        chunk = todo[start : start + batch_size]
        for i, vector in zip(chunk, embedder.embed([records[i].memory.text for i in chunk]), strict=False):
            out[i] = np.asarray(vector, dtype=np.float32)  # [dim]
    return out  # type: ignore[return-value]
