"""A tiny in-memory stand-in for kvmem.text's MemoryStore, used only until branch `text` lands.

Same method names and exceptions as the agreed API; search scores are word-overlap counts. Not a model of
the real store's ranking: tests that use it assert plumbing (who sees what), not retrieval quality.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from typing import Any


class TextStoreError(Exception):
    pass


class InvalidMemoryInput(TextStoreError, ValueError):
    pass


class MemoryNotFound(TextStoreError, KeyError):
    pass


@dataclass(frozen=True)
class Memory:
    id: str
    user_id: str
    text: str
    session_id: str | None = None
    agent_id: str | None = None
    chat_time: str | None = None
    tags: tuple[str, ...] = ()
    metadata: dict[str, Any] = field(default_factory=dict)
    created_at: str = ""
    updated_at: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "user_id": self.user_id,
            "text": self.text,
            "session_id": self.session_id,
            "agent_id": self.agent_id,
            "chat_time": self.chat_time,
            "tags": list(self.tags),
            "metadata": dict(self.metadata),
            "created_at": self.created_at,
            "updated_at": self.updated_at,
        }


@dataclass(frozen=True)
class SearchHit:
    memory: Memory
    score: float


@dataclass(frozen=True)
class Page:
    items: list[Memory]
    page: int
    page_size: int
    total: int


@dataclass(frozen=True)
class ChangeEvent:
    kind: str
    user_id: str
    memory_ids: tuple[str, ...]


class MemoryStore:
    def __init__(self, path: Any = None) -> None:
        self._lock = threading.RLock()
        self._rows: dict[str, Memory] = {}
        self._ids = itertools.count(1)
        self._subscribers: list[Callable[[ChangeEvent], None]] = []

    def _emit(self, kind: str, user_id: str, ids: list[str]) -> None:
        for cb in list(self._subscribers):
            cb(ChangeEvent(kind, user_id, tuple(ids)))

    def subscribe(self, cb: Callable[[ChangeEvent], None]) -> Callable[[], None]:
        self._subscribers.append(cb)
        return lambda: self._subscribers.remove(cb) if cb in self._subscribers else None

    def add(
        self,
        user_id,
        text=None,
        *,
        texts=None,
        messages=None,
        session_id=None,
        agent_id=None,
        chat_time=None,
        tags=None,
        metadata=None,
    ) -> list[Memory]:
        if sum(x is not None for x in (text, texts, messages)) != 1:
            raise InvalidMemoryInput("give exactly one of text, texts, messages")
        if messages is not None:
            if not messages:
                raise InvalidMemoryInput("messages must not be empty")
            chunks = ["\n".join(f"{m['role']}: {m['content']}" for m in messages)]
        else:
            chunks = [text] if text is not None else list(texts)
        if not chunks or any(not c.strip() for c in chunks):
            raise InvalidMemoryInput("memory text must not be empty")
        now = datetime.now(timezone.utc).isoformat()
        out = []
        with self._lock:
            for chunk in chunks:
                m = Memory(
                    f"mem-{next(self._ids):06d}",
                    user_id,
                    chunk,
                    session_id,
                    agent_id,
                    chat_time,
                    tuple(tags or ()),
                    dict(metadata or {}),
                    now,
                    now,
                )
                self._rows[m.id] = m
                out.append(m)
        self._emit("add", user_id, [m.id for m in out])
        return out

    def get(self, user_id: str, id: str) -> Memory:
        with self._lock:
            m = self._rows.get(id)
        if m is None or m.user_id != user_id:
            raise MemoryNotFound(id)
        return m

    def update(self, user_id, id, *, text=None, tags=None, metadata=None) -> Memory:
        m = self.get(user_id, id)
        if text is not None and not text.strip():
            raise InvalidMemoryInput("memory text must not be empty")
        new = replace(
            m,
            text=m.text if text is None else text,
            tags=m.tags if tags is None else tuple(tags),
            metadata=m.metadata if metadata is None else dict(metadata),
            updated_at=datetime.now(timezone.utc).isoformat(),
        )
        with self._lock:
            self._rows[id] = new
        self._emit("update", user_id, [id])
        return new

    def _delete_where(self, user_id: str, pred: Callable[[Memory], bool]) -> int:
        with self._lock:
            ids = [m.id for m in self._rows.values() if m.user_id == user_id and pred(m)]
            for i in ids:
                del self._rows[i]
        if ids:
            self._emit("delete", user_id, ids)
        return len(ids)

    def delete(self, user_id: str, id: str) -> int:
        return self._delete_where(user_id, lambda m: m.id == id)

    def delete_session(self, user_id: str, session_id: str) -> int:
        return self._delete_where(user_id, lambda m: m.session_id == session_id)

    def delete_user(self, user_id: str) -> int:
        return self._delete_where(user_id, lambda m: True)

    def _mine(self, user_id: str) -> list[Memory]:
        with self._lock:
            return sorted(
                (m for m in self._rows.values() if m.user_id == user_id), key=lambda m: m.id, reverse=True
            )

    def list(self, user_id, *, session_id=None, page=1, page_size=20) -> Page:
        rows = [m for m in self._mine(user_id) if session_id is None or m.session_id == session_id]
        start = (page - 1) * page_size
        return Page(rows[start : start + page_size], page, page_size, len(rows))

    def search(self, user_id, query, *, top_k=10, filters=None, min_score=None) -> list[SearchHit]:
        words = set(query.lower().split())
        hits = []
        for m in self._mine(user_id):
            if filters and filters.get("session_id") not in (None, m.session_id):
                continue
            if filters and filters.get("tags") and not set(filters["tags"]) & set(m.tags):
                continue
            score = float(len(words & set(m.text.lower().split())))
            if score > 0 and (min_score is None or score >= min_score):
                hits.append(SearchHit(m, score))
        hits.sort(key=lambda h: (-h.score, h.memory.id))
        return hits[:top_k]

    def memories_by_ids(self, user_id, ids) -> list[Memory]:
        return [m for m in (self._rows.get(i) for i in ids) if m is not None and m.user_id == user_id]

    def count(self, user_id: str) -> int:
        return len(self._mine(user_id))

    def close(self) -> None:
        pass
