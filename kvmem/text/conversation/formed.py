"""Formation's writes, mixed into MemoryStore: commit what was formed from log turns, and supersession.

Owns commit_formed (new memories with provenance, duplicates' provenance, supersessions and the turns marked
formed, in one transaction), supersede (one memory superseded by another) and slot_candidates (what a new
fact about a slot is compared with). A superseded memory keeps its row with valid_to and superseded_by set:
it is no longer served (search, list and memories_by_ids leave it out unless include_superseded) but stays
readable for questions about the past. Knows nothing of how facts are extracted or compared (kvmem/formation).
"""

from __future__ import annotations

import dataclasses
import json
import sqlite3
import uuid
from collections.abc import Callable
from datetime import datetime
from typing import Any

import numpy as np

from kvmem.text.config import TextStoreConfig
from kvmem.text.conversation import turns
from kvmem.text.conversation.context import FORMED_SOURCE, in_context
from kvmem.text.conversation.log import check_id_list
from kvmem.text.db.connections import Database, Tx
from kvmem.text.db.rows import (
    COLUMNS,
    SERVED,
    add_provenance,
    bump_generation,
    find_live,
    find_served,
    read_generation,
    row_to_memory,
    supersede_row,
)
from kvmem.text.errors import InvalidMemoryInput, MemoryNotFound, StaleFormation
from kvmem.text.filters import (
    check_int,
    check_memory_id,
    check_optional_id,
    check_text,
    check_user_id,
    format_time,
    parse_time,
)
from kvmem.text.records import ChangeEvent, CommitResult, FormedMemory, Memory
from kvmem.text.search.bm25 import num_tokens
from kvmem.text.search.rerank_features import speaker_of
from kvmem.text.search.vectors import VectorCache

FORMED_ROLE = "user"  # formed memories are what the user said


def superseded_until(old_valid_from: str | None, new_valid_from: str, now: str) -> str:
    """The valid_to a memory valid from `old_valid_from` gets when one valid from `new_valid_from` supersedes
    it: that time, or `now` when the old one became true later than that (the new fact is older news, yet it
    is the newer statement)."""
    assert old_valid_from is not None, "a stored memory has a valid_from"
    return now if old_valid_from > new_valid_from else new_valid_from


def _check_formed(add: Any, i: int, max_tokens: int, max_chars: int) -> FormedMemory:
    """adds[i] validated, its times in the store's UTC form."""
    where = f"adds[{i}]"
    if not isinstance(add, FormedMemory):
        raise InvalidMemoryInput(f"{where} must be a FormedMemory, got {type(add).__name__}")
    check_text(add.text, max_tokens, max_chars, f"{where}.text")
    source = check_id_list(add.source_turn_ids, f"{where}.source_turn_ids")
    if not source:
        raise InvalidMemoryInput(f"{where}.source_turn_ids must name at least one turn, got []")
    check_optional_id(add.session_id, f"{where}.session_id")
    check_optional_id(add.slot, f"{where}.slot")
    if add.slot_value is not None and not isinstance(add.slot_value, str):
        raise InvalidMemoryInput(f"{where}.slot_value must be a string or None, got {add.slot_value!r}")
    if not isinstance(add.kind, str) or not add.kind.strip():
        raise InvalidMemoryInput(f"{where}.kind must be a non-empty string, got {add.kind!r}")
    if add.speaker is not None and (not isinstance(add.speaker, str) or not add.speaker.strip()):
        raise InvalidMemoryInput(f"{where}.speaker must be a non-empty string or None, got {add.speaker!r}")
    return dataclasses.replace(
        add,
        source_turn_ids=tuple(source),
        valid_from=parse_time(add.valid_from, f"{where}.valid_from"),
        chat_time=parse_time(add.chat_time, f"{where}.chat_time"),
    )


def _check_pairs(pairs: Any, field_name: str) -> list[tuple]:
    if isinstance(pairs, str) or not isinstance(pairs, (list, tuple)):
        raise InvalidMemoryInput(f"{field_name} must be a list of pairs, got {pairs!r}")
    for i, pair in enumerate(pairs):
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise InvalidMemoryInput(f"{field_name}[{i}] must be a pair, got {pair!r}")
    return [tuple(p) for p in pairs]


def _check_old(old: Any, i: int, index: Any, num_adds: int) -> str | int:
    """The old side of supersessions[i]: a memory id, or the index of another add of the same commit."""
    if isinstance(old, int) and not isinstance(old, bool):
        check_int(old, f"supersessions[{i}][0]", 0, num_adds - 1)
        if old == index:
            raise InvalidMemoryInput(f"supersessions[{i}]: add {old} cannot supersede itself")
        return old
    if not isinstance(old, str) or not old:
        raise InvalidMemoryInput(f"supersessions[{i}][0] must be a memory id or an add index, got {old!r}")
    return old


def _check_adds(adds: Any, max_tokens: int, max_chars: int) -> list[FormedMemory]:
    if isinstance(adds, str) or not isinstance(adds, (list, tuple)):
        raise InvalidMemoryInput(f"adds must be a list of FormedMemory, got {adds!r}")
    return [_check_formed(a, i, max_tokens, max_chars) for i, a in enumerate(adds)]


def _within_batch(
    adds: list[FormedMemory], new_ids: dict[int, str], supersessions: list[tuple], now: str
) -> dict[int, tuple[str, str]]:
    """The adds superseded by a later add of the same commit, as {add index: (superseded_by, valid_to)}; only
    adds that are kept (`new_ids`) count, and the first pair naming an add wins."""
    out: dict[int, tuple[str, str]] = {}
    for old, index in supersessions:
        if isinstance(old, int) and old in new_ids and index in new_ids and old not in out:
            out[old] = (new_ids[index], superseded_until(adds[old].valid_from, adds[index].valid_from, now))
    return out


def _formed_memory(
    add: FormedMemory,
    memory_id: str,
    user_id: str,
    extractor: str,
    now: str,
    superseded: tuple[str, str] | None,
) -> Memory:
    """The memory an add becomes: said by the user (or by the speaker its turns name, kept in its metadata as
    an importer's memories keep theirs), from the conversation, superseded already if `superseded` =
    (superseded_by, valid_to)."""
    superseded_by, valid_to = superseded if superseded is not None else (None, None)
    metadata = {"kind": add.kind, "extractor": extractor}
    if add.speaker is not None:
        metadata["speaker"] = add.speaker
    return Memory(
        id=memory_id,
        user_id=user_id,
        session_id=add.session_id,
        agent_id=None,
        role=FORMED_ROLE,
        text=add.text,
        created_at=now,
        chat_time=add.chat_time,
        updated_at=now,
        tags=(),
        metadata=metadata,
        state="active",
        version=1,
        valid_from=add.valid_from,
        valid_to=valid_to,
        superseded_by=superseded_by,
        source=FORMED_SOURCE,
        source_turn_ids=add.source_turn_ids,
        slot=add.slot,
        slot_value=add.slot_value,
    )


def deleted_how(conn: sqlite3.Connection, user_id: str, memory_id: str) -> str | None:
    """How this user's memory was deleted: "forgotten" (`delete` without keep_turns: its tombstone says so,
    deletes.FORGOTTEN), "deleted" (a session's delete, or with its turns kept), None if it is no tombstone of
    theirs."""
    row = conn.execute(
        "SELECT metadata FROM memories WHERE user_id = ? AND id = ? AND state = 'deleted'",
        (user_id, memory_id),
    ).fetchone()
    if row is None:
        return None
    return "forgotten" if json.loads(row[0]).get("forgotten") is True else "deleted"


class FormationWrites:
    """commit_formed, supersede and slot_candidates on MemoryStore; the store provides what is declared here."""

    _db: Database
    _clock: Callable[[], datetime]
    _vectors: VectorCache
    config: TextStoreConfig
    _embed: Callable[[list[str]], np.ndarray]
    _insert: Callable[[sqlite3.Connection, Memory, bytes | None], int]

    def commit_formed(
        self,
        user_id: str,
        turn_ids: list[str],
        adds: list[FormedMemory],
        duplicates: list[tuple[str, tuple[str, ...]]],
        supersessions: list[tuple[str | int, int]],
        *,
        extractor: str,
        outdated: list[tuple[int, str]] | tuple[()] = (),
        expect_generation: int | None = None,
    ) -> CommitResult:
        """Commits one formation pass over this user's log turns `turn_ids`, in one transaction.

        `expect_generation`: the user's generation (`generation`) when the decisions were made; if their
        memories changed since (an edit would otherwise be retired, or a restatement joined to a text that no
        longer says it), StaleFormation is raised and nothing is written.

        - adds: new memories (source 'conversation', role 'user', metadata {"kind", "extractor"}). An add
          citing a turn that is not (or no longer) a turn of this user, e.g. deleted meanwhile, is dropped,
          and so is every supersession by it.
        - duplicates: (memory id, turn ids): an existing memory said again; its source_turn_ids gain those
          of the turns that still exist (no new version, no event). If the memory was deleted meanwhile, the
          restatement is not lost: when its delete forgot the fact (`delete`, turns not kept) the turns go
          too, retired as its own turns went (`retired`); else (a session's delete, keep_turns) they stay
          pending (`requeued`), for the next pass to form on their own.
        - supersessions: (old memory id, index into adds): if the old memory is still served, it gets
          valid_to (the add's valid_from, or now if the old one's valid_from is later) and superseded_by,
          as a new version; subscribers hear ChangeEvent(old id, "updated", text_changed=True). The old
          side may instead be an index into adds (a later fact of the batch supersedes an earlier one): that
          add is inserted already superseded (version 1, never served, no 'updated' event).
        - outdated: (index into adds, memory id): a newer memory sets the add's slot otherwise, so the add is
          inserted already superseded by it (valid_to: that memory's valid_from, or now if the add's is later)
          if it is still live; else it is added as current.
        A memory is superseded once: the first pair naming it wins. The turns among `turn_ids` still pending
        or dead become 'formed'. Events after the commit: 'added' per memory added, in order, then 'updated'
        per existing memory superseded. superseded_ids lists both kinds, in the order of `supersessions`.
        """
        check_user_id(user_id)
        ids = check_id_list(turn_ids, "turn_ids")
        if not isinstance(extractor, str) or not extractor.strip():
            raise InvalidMemoryInput(f"extractor must be a non-empty string, got {extractor!r}")
        adds = _check_adds(adds, self.config.max_text_tokens, self.config.max_text_chars)
        duplicates = [
            (check_memory_id(memory_id), check_id_list(ids_, f"duplicates[{i}][1]"))
            for i, (memory_id, ids_) in enumerate(_check_pairs(duplicates, "duplicates"))
        ]
        supersessions = [
            (
                _check_old(old, i, index, len(adds)),
                check_int(index, f"supersessions[{i}][1]", 0, len(adds) - 1),
            )
            for i, (old, index) in enumerate(_check_pairs(supersessions, "supersessions"))
        ]
        outdated_by: dict[int, str] = {}
        for i, (index, newer) in enumerate(_check_pairs(outdated, "outdated")):
            outdated_by.setdefault(
                check_int(index, f"outdated[{i}][0]", 0, len(adds) - 1), check_memory_id(newer)
            )
        vectors = self._formed_vectors(user_id, adds) if adds else None  # [len(adds), dim]
        now = format_time(self._clock())
        with self._db.write(user_id) as tx:
            if expect_generation is not None and read_generation(tx.conn, user_id) != expect_generation:
                raise StaleFormation(f"user {user_id!r}: memories changed while formation decided")
            cited = [
                *ids,
                *(t for a in adds for t in a.source_turn_ids),
                *(t for _, ts in duplicates for t in ts),
            ]
            existing = turns.existing_turn_ids(tx.conn, user_id, cited)
            new_ids = {
                i: uuid.uuid4().hex
                for i, add in enumerate(adds)
                if all(t in existing for t in add.source_turn_ids)
            }
            born_superseded = _within_batch(adds, new_ids, supersessions, now)
            for i, newer_id in outdated_by.items():  # history already: a newer memory says otherwise
                newer = find_live(tx.conn, user_id, newer_id)
                if i in new_ids and i not in born_superseded and newer is not None:
                    assert newer.memory.valid_from is not None, newer_id
                    valid_to = superseded_until(adds[i].valid_from, newer.memory.valid_from, now)
                    born_superseded[i] = (newer_id, valid_to)
            added = {
                i: _formed_memory(adds[i], memory_id, user_id, extractor, now, born_superseded.get(i))
                for i, memory_id in new_ids.items()
            }
            rowids = [self._insert(tx.conn, m, vectors[i].tobytes()) for i, m in added.items()]
            retired: list[str] = []  # restatements of a fact forgotten meanwhile: they go as its turns did
            held: list[str] = []  # restatements of a memory deleted otherwise: formed again on their own
            for memory_id, gained in duplicates:
                found = find_live(tx.conn, user_id, memory_id)
                gained = [t for t in gained if t in existing]
                if found is not None and gained:
                    add_provenance(tx.conn, found, gained)
                elif found is None and gained:
                    how = deleted_how(tx.conn, user_id, memory_id)
                    if how is not None:
                        (retired if how == "forgotten" else held).extend(gained)
            superseded: list[str] = []  # every memory superseded here, in the order of `supersessions`
            updated: list[str] = []  # the existing ones among them
            for old, index in supersessions:
                if index not in added:
                    continue
                if isinstance(old, int):
                    if old in added and added[old].superseded_by == added[index].id:
                        superseded.append(added[old].id)
                    continue
                found = find_served(tx.conn, user_id, old)
                if found is not None:
                    valid_to = superseded_until(found.memory.valid_from, added[index].valid_from, now)
                    supersede_row(tx.conn, found, added[index].id, valid_to, now)
                    superseded.append(old)
                    updated.append(old)
            for i, newer_id in outdated_by.items():
                if i in added and added[i].superseded_by == newer_id:
                    superseded.append(added[i].id)
            turns.delete_turn_ids(tx.conn, user_id, retired)
            turns.mark_formed(tx.conn, user_id, [t for t in ids if t not in set(held)], now)
            if added:
                kept = vectors[list(added)]  # [len(added), dim]
                self._refresh_vectors(tx, user_id, rowids, list(added.values()), kept, bool(superseded))
            tx.events.extend(ChangeEvent(m.id, user_id, "added") for m in added.values())
            tx.events.extend(ChangeEvent(old_id, user_id, "updated", text_changed=True) for old_id in updated)
        superseded = list(dict.fromkeys(superseded))
        return CommitResult(
            added=list(added.values()),
            superseded_ids=superseded,
            dropped=len(adds) - len(added),
            requeued=len(set(held) - set(retired)),
            retired=len(set(retired)),
        )

    def _formed_vectors(self, user_id: str, adds: list[FormedMemory]) -> np.ndarray:
        """[len(adds), dim]: each add's vector in the context of its source turns (context.in_context), read
        before the write transaction (an add whose turn is deleted meanwhile is dropped inside it)."""
        said = turns.cited_texts(self._db.conn(), user_id, [a.source_turn_ids for a in adds])
        return in_context(self._embed, [a.text for a in adds], said)

    def _refresh_vectors(
        self,
        tx: Tx,
        user_id: str,
        rowids: list[int],
        memories: list[Memory],
        vectors: np.ndarray,
        invalidate: bool,
    ) -> None:
        """Bumps the user's generation; after the commit the cached matrix grows by the new rows (`rowids`,
        `vectors` [len(rowids), dim]) as add's does, or is dropped when a row left the served set."""
        gen = bump_generation(tx.conn, user_id)
        if invalidate:
            tx.after_commit.append(lambda: self._vectors.invalidate(user_id))
            return
        rowid_array = np.asarray(rowids, dtype=np.int64)
        sessions = [m.session_id for m in memories]
        speakers = [speaker_of(m.role, m.metadata) for m in memories]
        texts = [m.text for m in memories]
        lengths = [num_tokens(text) for text in texts]
        tx.after_commit.append(
            lambda: self._vectors.append(
                user_id, gen - 1, gen, rowid_array, vectors, sessions, speakers, lengths, texts
            )
        )

    def supersede(self, user_id: str, old_id: str, new_id: str) -> Memory:
        """Marks this user's served memory `old_id` superseded by their served memory `new_id` (valid_to: the
        new one's valid_from, or now if the old one's is later); returns the old memory as it now is.

        MemoryNotFound if either is not a served memory of this user; InvalidMemoryInput if they are the same.
        Subscribers hear ChangeEvent(old_id, "updated", text_changed=True).
        """
        check_user_id(user_id)
        check_memory_id(old_id)
        check_memory_id(new_id)
        if old_id == new_id:
            raise InvalidMemoryInput(
                f"a memory cannot supersede itself: old_id and new_id are both {old_id!r}"
            )
        with self._db.write(user_id) as tx:
            old = find_served(tx.conn, user_id, old_id)
            if old is None:
                raise MemoryNotFound(old_id, user_id)
            new = find_served(tx.conn, user_id, new_id)
            if new is None:
                raise MemoryNotFound(new_id, user_id)
            now = format_time(self._clock())
            assert new.memory.valid_from is not None, new_id
            valid_to = superseded_until(old.memory.valid_from, new.memory.valid_from, now)
            memory = supersede_row(tx.conn, old, new_id, valid_to, now)
            bump_generation(tx.conn, user_id)
            tx.after_commit.append(lambda: self._vectors.invalidate(user_id))
            tx.events.append(ChangeEvent(old_id, user_id, "updated", text_changed=True))
        return memory

    def slot_candidates(self, user_id: str, slot: str, *, prefix: bool = False) -> list[Memory]:
        """This user's served memories that set `slot`, oldest first (valid_from, then insertion): what a new
        fact about the slot is consolidated against. With `prefix`, also every slot under it (`slot|...`:
        "user|partner" finds "user|partner|name"), for a fact that clears a whole subject."""
        check_user_id(user_id)
        if not isinstance(slot, str) or not slot.strip():
            raise InvalidMemoryInput(f"slot must be a non-empty string, got {slot!r}")
        if not isinstance(prefix, bool):
            raise InvalidMemoryInput(f"prefix must be a bool, got {prefix!r}")
        # '}' follows '|' in code point order, so [slot + '|', slot + '}') holds exactly the names under it
        match, params = (
            ("m.slot = ?", [slot])
            if not prefix
            else (
                "(m.slot = ? OR (m.slot >= ? AND m.slot < ?))",
                [slot, slot + "|", slot + "}"],
            )
        )
        rows = (
            self._db.conn()
            .execute(
                f"SELECT {COLUMNS} FROM memories m WHERE m.user_id = ? AND {match} AND {SERVED} "
                "ORDER BY m.valid_from, m.rowid",
                (user_id, *params),
            )
            .fetchall()
        )
        return [row_to_memory(r) for r in rows]
