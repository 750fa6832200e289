"""The conversation log's public calls, mixed into MemoryStore: append turns, page them, and the formation
queue (pending, failed, dead, requeued, counted).

Chat turns are logged here, apart from memories: appending a turn writes no memory and emits no ChangeEvent.
The formation pipeline (kvmem/formation) reads pending turns and commits what it formed through
MemoryStore.commit_formed (formed.py). Each call checks its arguments, then runs one transaction of turns.py
statements. Knows nothing of search, embeddings or how facts are extracted.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from datetime import datetime
from typing import Any

from kvmem.text.config import TextStoreConfig
from kvmem.text.conversation import turns
from kvmem.text.db.connections import Database
from kvmem.text.db.rows import erased_generation, live_by_ids
from kvmem.text.errors import InvalidMemoryInput
from kvmem.text.filters import (
    TURN_MESSAGE_KEYS,
    check_int,
    check_optional_id,
    check_user_id,
    format_time,
    parse_messages,
    parse_time,
)
from kvmem.text.records import FormationCounts, Turn, TurnPage


def check_id_list(ids: Any, field_name: str) -> list[str]:
    """A list (or tuple) of non-empty id strings, duplicates dropped, first occurrence kept."""
    if isinstance(ids, str) or not isinstance(ids, (list, tuple)):
        raise InvalidMemoryInput(f"{field_name} must be a list of ids, got {ids!r}")
    for i, value in enumerate(ids):
        if not isinstance(value, str) or not value:
            raise InvalidMemoryInput(f"{field_name}[{i}] must be a non-empty string, got {value!r}")
    return list(dict.fromkeys(ids))


def _check_roles(roles: Any) -> frozenset[str]:
    if isinstance(roles, str) or not isinstance(roles, (list, tuple, set, frozenset)):
        raise InvalidMemoryInput(f"form_roles must be a tuple of role names, got {roles!r}")
    for role in roles:
        if not isinstance(role, str) or not role.strip():
            raise InvalidMemoryInput(f"form_roles must hold non-empty strings, got {role!r}")
    return frozenset(roles)


class ConversationLog:
    """The log's calls on MemoryStore; the store provides the database, config and clock below."""

    _db: Database
    _clock: Callable[[], datetime]
    config: TextStoreConfig

    def log_turns(
        self,
        user_id: str,
        messages: list[dict],
        *,
        session_id: str | None = None,
        chat_time: str | datetime | None = None,
        form_roles: tuple[str, ...] = ("user",),
        admitted_generation: int | None = None,
        reply_to: str | None = None,
        used_memory_ids: list[str] | tuple[str, ...] = (),
    ) -> list[Turn]:
        """Appends one turn per chat message `{role, content, chat_time?, name?}` (name: the speaker's),
        in order; returns them. chat_time: the message's own, else the call's, else now. Turns whose role is
        in `form_roles` are queued for formation ('pending'), the others 'skipped'. One transaction; writes
        no memory and emits no event. Text limits as add's.

        `admitted_generation`: the user's `generation()` when the request these turns come from was admitted.
        If the user was wholly deleted since (`delete_user`), nothing is appended and [] is returned: the
        check and the append are one transaction, so a turn in flight during a delete-all is never stored
        after the delete returned. The same holds for a session: if `session_id` was deleted
        (`delete_session`) after that generation, nothing is appended.

        `reply_to`: the id of the turn these messages answer (a reply); `used_memory_ids`: the memories they
        were generated with. Both are what a memory's delete reaches (deletes.py: the replies to its source
        turns and the replies that used it go with it). If `reply_to` is no longer a turn of this user, or a
        memory in `used_memory_ids` was deleted, nothing is appended and [] is returned: a reply to a turn
        that is gone, or made from a memory that is gone, is not logged after its delete returned.
        """
        check_user_id(user_id)
        check_optional_id(session_id, "session_id")
        roles = _check_roles(form_roles)
        call_time = parse_time(chat_time, "chat_time") if chat_time is not None else None
        items = parse_messages(
            messages, call_time, self.config.max_text_tokens, self.config.max_text_chars, TURN_MESSAGE_KEYS
        )
        now = format_time(self._clock())
        logged = [
            Turn(
                id=uuid.uuid4().hex,
                user_id=user_id,
                session_id=session_id,
                role=item.role,
                speaker=item.name,
                text=item.text,
                chat_time=item.chat_time or now,
                created_at=now,
                formation="pending" if item.role in roles else "skipped",
                attempts=0,
                error=None,
                updated_at=now,
            )
            for item in items
        ]
        if admitted_generation is not None:
            check_int(admitted_generation, "admitted_generation", 0, 2**63 - 1)
        check_optional_id(reply_to, "reply_to")
        used = check_id_list(used_memory_ids, "used_memory_ids")
        with self._db.write(user_id) as tx:
            if admitted_generation is not None and (
                erased_generation(tx.conn, user_id) > admitted_generation
                or (
                    session_id is not None
                    and turns.session_erased_generation(tx.conn, user_id, session_id) > admitted_generation
                )
            ):
                return []
            if reply_to is not None and not turns.existing_turn_ids(tx.conn, user_id, [reply_to]):
                return []
            if used and len(live_by_ids(tx.conn, user_id, used)) < len(used):
                return []
            turns.insert_turns(tx.conn, logged, reply_to, used)
        return logged

    def list_turns(
        self,
        user_id: str,
        *,
        session_id: str | None = None,
        page: int = 1,
        page_size: int = 20,
        start: str | datetime | None = None,
        end: str | datetime | None = None,
    ) -> TurnPage:
        """This user's log (one session's, if given; said between `start` and `end`, inclusive, if given: what
        the user said last week), newest first: chat_time, then insertion order."""
        check_user_id(user_id)
        check_optional_id(session_id, "session_id")
        check_int(page, "page", 1, 2**31)
        check_int(page_size, "page_size", 1, self.config.max_page_size)
        start = None if start is None else parse_time(start, "start")
        end = None if end is None else parse_time(end, "end")
        with self._db.snapshot() as conn:
            items, total = turns.page_turns(
                conn, user_id, session_id, page_size, (page - 1) * page_size, start, end
            )
        return TurnPage(items=items, page=page, page_size=page_size, total=total)

    def pending_turns(self, user_id: str, limit: int = 64) -> list[Turn]:
        """This user's turns waiting for formation, oldest first (chat_time, then insertion), at most `limit`."""
        check_user_id(user_id)
        check_int(limit, "limit", 1, self.config.max_page_size)
        return turns.turns_in_state(self._db.conn(), user_id, "pending", limit)

    def users_with_pending_turns(self) -> list[str]:
        """Every user with a turn waiting for formation, sorted (an operator view: it names all users)."""
        return turns.users_with_pending(self._db.conn())

    def fail_turns(self, user_id: str, turn_ids: list[str], error: str, *, dead: bool) -> None:
        """Records a failed formation attempt on this user's pending turns among `turn_ids`: attempts + 1,
        `error` kept (its first 500 characters), and the turns given up on ('dead') if `dead`, else left
        pending for another try. Other users' ids and turns not pending are left alone."""
        check_user_id(user_id)
        ids = check_id_list(turn_ids, "turn_ids")
        if not isinstance(error, str):
            raise InvalidMemoryInput(f"error must be a string, got {type(error).__name__}")
        if not isinstance(dead, bool):
            raise InvalidMemoryInput(f"dead must be a bool, got {dead!r}")
        with self._db.write(user_id) as tx:
            turns.fail(tx.conn, user_id, ids, error, dead, format_time(self._clock()))

    def dead_turns(self, user_id: str, limit: int = 100) -> list[Turn]:
        """This user's turns given up on, oldest first, at most `limit`."""
        check_user_id(user_id)
        check_int(limit, "limit", 1, self.config.max_page_size)
        return turns.turns_in_state(self._db.conn(), user_id, "dead", limit)

    def requeue_dead_turns(self, user_id: str) -> int:
        """Puts this user's dead turns back in the queue (pending, attempts 0, error cleared); returns how many."""
        check_user_id(user_id)
        with self._db.write(user_id) as tx:
            return turns.requeue_dead(tx.conn, user_id, format_time(self._clock()))

    def requeue_all_dead_turns(self) -> int:
        """Every user's dead turns go back in the queue (an operator's call, after an extractor outage or fix);
        returns how many."""
        with self._db.write() as tx:
            return turns.requeue_dead(tx.conn, None, format_time(self._clock()))

    def formation_counts(self, user_id: str | None = None) -> FormationCounts:
        """How many turns wait for formation and how many were given up on: one user's, or all (None)."""
        if user_id is not None:
            check_user_id(user_id)
        return turns.count_states(self._db.conn(), user_id)
