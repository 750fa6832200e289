"""Named results the plaintext store hands across module boundaries.

Owns the shapes (Memory, MemoryVersion, SearchHit, Page, ChangeEvent; the conversation log's Turn, TurnPage,
FormationCounts; formation's FormedMemory and CommitResult) and their JSON forms; knows nothing of SQLite or
search.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

STATES = ("active", "archived", "deleted")
EVENT_KINDS = ("added", "updated", "deleted")
SOURCES = ("api", "conversation")  # added directly (add, import) / formed from the conversation log
FORMATION_STATES = ("pending", "formed", "skipped", "dead")


@dataclass(frozen=True)
class Memory:
    """One memory as stored. Times are ISO 8601 UTC strings (fixed width, so they sort as text).

    valid_from / valid_to: when what it says became / stopped being true (valid_from: chat_time unless formation
    knew better; valid_to: set when a newer memory superseded it, `superseded_by`). A memory is served (searched,
    listed, handed to the KV tiers) while it is active and not superseded. source: 'api' (added directly) or
    'conversation' (formed from the log turns `source_turn_ids`). slot / slot_value: the subject and attribute
    it sets ("user|home_city") and its normalized value, which decide what a newer memory supersedes.
    """

    id: str
    user_id: str
    session_id: str | None
    agent_id: str | None
    role: str | None
    text: str
    created_at: str
    chat_time: str
    updated_at: str
    tags: tuple[str, ...]
    metadata: dict
    state: str
    version: int
    valid_from: str | None = None  # None only before insert; the store writes chat_time then
    valid_to: str | None = None
    superseded_by: str | None = None
    source: str = "api"
    source_turn_ids: tuple[str, ...] = ()
    slot: str | None = None
    slot_value: str | None = None

    @property
    def is_served(self) -> bool:
        """Active and not superseded: what search, listings and the KV tiers hand out by default."""
        return self.state == "active" and self.valid_to is None

    @property
    def shown_state(self) -> str:
        """The state the API shows: 'superseded' for an active memory a newer one superseded (valid_to set),
        else the stored state ('active' or 'archived'). The stored column stays 'active' (a delete of the newer
        memory leaves it superseded; see MemoryDeletes.delete)."""
        return "superseded" if self.state == "active" and self.valid_to is not None else self.state

    def to_dict(self) -> dict[str, Any]:
        """The API's JSON form (`state` is shown_state); a dump adds what it needs to load back whole."""
        return {
            "id": self.id,
            "user_id": self.user_id,
            "session_id": self.session_id,
            "agent_id": self.agent_id,
            "role": self.role,
            "text": self.text,
            "created_at": self.created_at,
            "chat_time": self.chat_time,
            "updated_at": self.updated_at,
            "tags": list(self.tags),
            "metadata": dict(self.metadata),
            "state": self.shown_state,
            "version": self.version,
            "valid_from": self.valid_from,
            "valid_to": self.valid_to,
            "superseded_by": self.superseded_by,
            "source": self.source,
            "source_turn_ids": list(self.source_turn_ids),
            "slot": self.slot,
        }


@dataclass(frozen=True)
class MemoryVersion:
    """A previous version of a memory: what it said before update number `version + 1` replaced it."""

    version: int
    text: str
    tags: tuple[str, ...]
    metadata: dict
    updated_at: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "text": self.text,
            "tags": list(self.tags),
            "metadata": dict(self.metadata),
            "updated_at": self.updated_at,
        }


@dataclass(frozen=True)
class SearchHit:
    """A search result. score: keyword = BM25 (higher is better), dense = cosine, hybrid = fused in [0, 1]."""

    memory: Memory
    score: float


@dataclass(frozen=True)
class Page:
    """One page of a listing; `total` counts every memory the listing's filters match."""

    items: list[Memory]
    page: int
    page_size: int
    total: int


@dataclass(frozen=True)
class ChangeEvent:
    """Emitted after a commit: memory `memory_id` of `user_id` was added, updated or deleted. An update with
    `text_changed` False changed only tags or metadata: what the memory says (text, state) is as before.
    `batch`: every memory id one transaction deleted, on each of its 'deleted' events when there were several
    (a subscriber may handle them all at the first and skip the rest); not compared."""

    memory_id: str
    user_id: str
    kind: str
    text_changed: bool = True
    batch: tuple[str, ...] = field(default=(), compare=False)


@dataclass(frozen=True)
class Turn:
    """One turn of the conversation log, kept apart from memories. formation: 'pending' (waiting for the
    formation pipeline), 'formed' (its facts were committed), 'skipped' (a role that is not formed, e.g. the
    assistant's) or 'dead' (failed too often; `error` says why). speaker: the name a message gave, if any."""

    id: str
    user_id: str
    session_id: str | None
    role: str
    speaker: str | None
    text: str
    chat_time: str
    created_at: str
    formation: str
    attempts: int
    error: str | None
    updated_at: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "user_id": self.user_id,
            "session_id": self.session_id,
            "role": self.role,
            "speaker": self.speaker,
            "text": self.text,
            "chat_time": self.chat_time,
            "created_at": self.created_at,
            "formation": self.formation,
            "attempts": self.attempts,
            "error": self.error,
            "updated_at": self.updated_at,
        }


@dataclass(frozen=True)
class TurnPage:
    """One page of a user's log, newest first; `total` counts every turn the listing matches."""

    items: list[Turn]
    page: int
    page_size: int
    total: int


@dataclass(frozen=True)
class FormationCounts:
    """Log turns waiting for formation (`pending`) and given up on (`dead`)."""

    pending: int
    dead: int


@dataclass(frozen=True)
class FormedMemory:
    """A memory the formation pipeline commits (MemoryStore.commit_formed): its text, the log turns it came
    from, when it became true, the chat_time and session it is filed under, the slot it sets, its kind, and who
    said it where the log names its speakers (an import of a multi-party chat; None: the user themselves)."""

    text: str
    source_turn_ids: tuple[str, ...]
    valid_from: str
    chat_time: str
    session_id: str | None = None
    slot: str | None = None
    slot_value: str | None = None
    kind: str = "fact"
    speaker: str | None = None


@dataclass(frozen=True)
class CommitResult:
    """What commit_formed wrote: the memories added (in the order of the adds kept), the ids of the memories
    they superseded (or that were added superseded), how many adds were dropped because a turn they cite was
    deleted meanwhile, how many turns restating a memory deleted meanwhile were left pending to be formed
    again (`requeued`) or deleted with the fact they restate (`retired`)."""

    added: list[Memory]
    superseded_ids: list[str]
    dropped: int
    requeued: int = 0
    retired: int = 0
