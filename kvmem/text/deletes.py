"""Deleting memories, mixed into MemoryStore, and the cascade to the conversation log.

Owns delete, delete_session and delete_user: live memories become tombstones (rows.tombstone) and the log
turns they came from, with the replies to those turns and the replies generated with the memories, or the
session's, or the user's whole log, are hard-deleted in the same transaction. A deleted session or user is
fenced: a turn of a request admitted before the delete is not logged into it after (log_turns).
Deleting a memory that superseded another leaves the old one superseded (its valid_to is history, and
un-superseding would need a judgement the store does not make). Knows nothing of search or formation.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import datetime
from typing import Any

from kvmem.text.conversation.turns import (
    delete_turn_ids,
    delete_turns_where,
    mark_session_erased,
    replies_to,
    requeue,
    turns_using,
)
from kvmem.text.db.connections import Database
from kvmem.text.db.rows import (
    LIVE,
    bump_generation,
    live_ids,
    mark_erased,
    read_generation,
    source_turn_ids,
    tombstone,
)
from kvmem.text.errors import InvalidMemoryInput
from kvmem.text.filters import check_memory_id, check_optional_id, check_user_id, format_time
from kvmem.text.records import ChangeEvent
from kvmem.text.search.vectors import VectorCache

# a tombstone's metadata when its fact was forgotten (delete, turns not kept): a formation pass that judged a
# turn to restate it retires that turn as well (commit_formed)
FORGOTTEN = '{"forgotten": true}'


def _words(text: str) -> str:
    return " ".join(re.findall(r"\w+", text.lower()))


def restating_turns(conn: Any, user_id: str, where: str, params: list[Any]) -> list[str]:
    """This user's turns still waiting for formation (pending or dead) whose words contain, in order, all the
    words of a live memory matching `where`: a fact said again and not yet formed, retired with the memory so
    that it does not come back. A restatement in other words is caught when a pass forms it (commit_formed)."""
    texts = [
        _words(r[0])
        for r in conn.execute(
            f"SELECT m.text FROM memories m WHERE m.user_id = ? AND {LIVE} AND {where}", [user_id, *params]
        )
    ]
    texts = [t for t in texts if t]
    if not texts:
        return []
    waiting = conn.execute(
        "SELECT id, text FROM turns WHERE user_id = ? AND formation IN ('pending', 'dead')", (user_id,)
    ).fetchall()
    return [i for i, text in waiting if any(f" {t} " in f" {_words(text)} " for t in texts)]


def mark_forgotten(conn: Any, user_id: str, ids: list[str]) -> None:
    """These tombstones of this user forgot their fact (FORGOTTEN)."""
    for memory_id in ids:
        conn.execute(
            "UPDATE memories SET metadata = ? WHERE user_id = ? AND id = ? AND state = 'deleted'",
            (FORGOTTEN, user_id, memory_id),
        )


class MemoryDeletes:
    """The deletes on MemoryStore; the store provides what is declared here."""

    _db: Database
    _clock: Callable[[], datetime]
    _vectors: VectorCache

    def generation(self, user_id: str) -> int:
        """The user's generation: it moves with every change to what their memories say (an add, a text or
        state change, a delete, a supersession), in the change's own transaction; 0 for a user never written.
        One indexed read, for callers that cache what they read of a user's memories (the scheduler's refresh)
        or prepared a request from them: an unchanged generation means nothing was deleted since."""
        check_user_id(user_id)
        return read_generation(self._db.conn(), user_id)

    def delete(self, user_id: str, memory_id: str, *, delete_turns: bool = True) -> int:
        """Deletes one memory; returns 1, or 0 if there was no such live memory of this user. With
        `delete_turns`, the log turns it was formed from (its source_turn_ids, this user's only) are deleted
        too, whatever other memories cite them, and so are the replies to those turns, every reply
        generated with the memory (log_turns' `reply_to` and `used_memory_ids`): they repeat it, and the turns
        still waiting for formation that say it again (`restating_turns`; a pass forming one meanwhile retires
        it at its commit): the fact does not come back. Without, the log is left as it is. A memory this one
        superseded stays superseded."""
        check_user_id(user_id)
        check_memory_id(memory_id)
        return self._delete_where(user_id, "m.id = ?", [memory_id], forget=delete_turns)

    def delete_session(self, user_id: str, session_id: str) -> int:
        """Deletes every memory of one session of this user and the session's log turns; returns how many
        memories. A turn of another session that a deleted memory also cites (the fact said again there) is
        kept and goes back to pending, so the next formation pass forms what it says on its own. The user's
        generation moves even when the session had only log turns, and is recorded as the one the session
        was erased at: a turn of a request admitted before this call is not logged into
        the session after it (log_turns' `admitted_generation`)."""
        check_user_id(user_id)
        if check_optional_id(session_id, "session_id") is None:
            raise InvalidMemoryInput("session_id must be a non-empty string, got None")
        return self._delete_where(user_id, "m.session_id = ?", [session_id], session=session_id)

    def delete_user(self, user_id: str) -> int:
        """Deletes every memory of this user and their whole conversation log; returns how many memories. The
        user's generation moves even when they had only log turns, and is recorded as the one they were erased
        at: a turn of a request admitted before this call is not logged after it (log_turns'
        `admitted_generation`)."""
        check_user_id(user_id)
        return self._delete_where(user_id, "1 = 1", [], whole_log=True)

    def _delete_where(
        self,
        user_id: str,
        where: str,
        params: list[Any],
        *,
        forget: bool = False,
        session: str | None = None,
        whole_log: bool = False,
    ) -> int:
        """Tombstones matching live memories (see rows.tombstone) and hard-deletes log turns: one memory forgotten
        (`forget`: its source turns, the replies to them and with it, and the pending turns that restate it), one
        session's (`session`) or all the user's (`whole_log`); the three are exclusive. Subscribers hear 'deleted'
        before this returns, each event naming the whole `batch` when several were deleted."""
        with self._db.write(user_id) as tx:
            bumped = False
            if whole_log:
                delete_turns_where(tx.conn, user_id, None)
                mark_erased(tx.conn, user_id)  # bumps the generation, memories or not
                bumped = True
            elif session is not None:
                delete_turns_where(tx.conn, user_id, session)
                # bumps the generation, memories or not: a turn of a request admitted before is not logged
                # into the session after this returns (log_turns' admitted_generation)
                mark_session_erased(tx.conn, user_id, session, bump_generation(tx.conn, user_id))
                bumped = True
            ids = live_ids(tx.conn, user_id, where, params)
            if not ids:
                return 0
            if session is not None:
                # its own turns went above; a memory of it may also cite another session's turn (the fact said
                # again there): that turn stays, and is formed again on its own by the next pass
                requeue(
                    tx.conn,
                    user_id,
                    source_turn_ids(tx.conn, user_id, where, params),
                    format_time(self._clock()),
                )
            elif forget:  # this fact, not a conversation
                sources = source_turn_ids(tx.conn, user_id, where, params)
                # the replies to its source turns and the replies made with it repeat it: they go too
                replies = [*replies_to(tx.conn, user_id, sources), *turns_using(tx.conn, user_id, ids)]
                restated = restating_turns(tx.conn, user_id, where, params)
                delete_turn_ids(tx.conn, user_id, [*sources, *replies, *restated])
            tombstone(tx.conn, user_id, where, params, format_time(self._clock()))
            if forget:  # a pass forming a restatement of it meanwhile retires that turn too (commit_formed)
                mark_forgotten(tx.conn, user_id, ids)
            if not bumped:
                bump_generation(tx.conn, user_id)
            tx.after_commit.append(lambda: self._vectors.invalidate(user_id))
            batch = tuple(ids) if len(ids) > 1 else ()  # subscribers may cascade once for the whole delete
            tx.events.extend(ChangeEvent(memory_id, user_id, "deleted", batch=batch) for memory_id in ids)
        return len(ids)
