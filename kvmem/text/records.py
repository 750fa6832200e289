"""Named results the plaintext store hands across module boundaries.

Owns the shapes (Memory, MemoryVersion, SearchHit, Page, ChangeEvent) and their JSON forms; knows nothing of
SQLite or search.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

STATES = ("active", "archived", "deleted")
EVENT_KINDS = ("added", "updated", "deleted")


@dataclass(frozen=True)
class Memory:
    """One memory as stored. Times are ISO 8601 UTC strings (fixed width, so they sort as text)."""

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

    def to_dict(self) -> dict[str, Any]:
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
            "state": self.state,
            "version": self.version,
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
    `text_changed` False changed only tags or metadata: what the memory says (text, state) is as before."""

    memory_id: str
    user_id: str
    kind: str
    text_changed: bool = True
