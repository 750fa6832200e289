"""An async adapter with the AgentScope runtime memory-service shape, over a MemoryStore.

Owns converting AgentScope-style messages (objects or dicts with role and text content parts) to and from
memories; store calls run in a worker thread so the event loop never blocks. Knows nothing of agentscope
itself (not imported): results are `AgentMessage`s with the same attributes as its Message.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass, field
from typing import Any

from kvmem.text.config import TextStoreConfig
from kvmem.text.errors import InvalidMemoryInput, TextStoreError
from kvmem.text.records import Memory
from kvmem.text.search.embedders import Embedder
from kvmem.text.store import MemoryStore

_PAGING_KEYS = ("page_num", "page_size")


@dataclass(frozen=True)
class TextPart:
    """A text content part, as AgentScope's TextContent (`type == "text"`, `.text`)."""

    text: str
    type: str = "text"


@dataclass(frozen=True)
class AgentMessage:
    """A memory as an AgentScope-runtime Message: `.type == "message"`, `.role`, `.content[i].text`."""

    id: str
    role: str
    content: list[TextPart]
    type: str = "message"
    metadata: dict = field(default_factory=dict)


def _get(obj: Any, name: str, default: Any = None) -> Any:
    return obj.get(name, default) if isinstance(obj, dict) else getattr(obj, name, default)


def message_text(message: Any) -> str:
    """The text of a message: its content if a string, else its text parts joined by newlines."""
    content = _get(message, "content")
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    parts = [_get(part, "text") for part in content if _get(part, "type", "text") == "text"]
    return "\n".join(p for p in parts if isinstance(p, str) and p)


def _to_message(memory: Memory, score: float | None = None) -> AgentMessage:
    metadata = {
        "session_id": memory.session_id,
        "chat_time": memory.chat_time,
        "tags": list(memory.tags),
        **memory.metadata,
    }
    if score is not None:
        metadata["score"] = score
    return AgentMessage(
        id=memory.id, role=memory.role or "user", content=[TextPart(memory.text)], metadata=metadata
    )


class AgentScopeMemoryService:
    """start/stop/health/add_memory/search_memory/list_memory/delete_memory over a MemoryStore.

    Give it a store (not closed by stop), or a path (opened by start, closed by stop).
    """

    def __init__(
        self,
        store: MemoryStore | None = None,
        *,
        path: str | os.PathLike | None = None,
        embedder: Embedder | None = None,
        config: TextStoreConfig | None = None,
        default_top_k: int = 5,
    ) -> None:
        if (store is None) == (path is None):
            raise InvalidMemoryInput("AgentScopeMemoryService needs exactly one of store or path")
        self._store = store
        self._owns_store = store is None
        self._path, self._embedder, self._config = path, embedder, config
        self._default_top_k = default_top_k

    def _require(self) -> MemoryStore:
        if self._store is None:
            raise TextStoreError("memory service is not started")
        return self._store

    async def start(self) -> None:
        if self._store is None:
            self._store = await asyncio.to_thread(MemoryStore, self._path, self._embedder, self._config)

    async def stop(self) -> None:
        if self._owns_store and self._store is not None:
            store, self._store = self._store, None
            await asyncio.to_thread(store.close)

    async def health(self) -> bool:
        if self._store is None:
            return False
        try:
            await asyncio.to_thread(self._store.count, "__health__")
        except TextStoreError:
            return False
        return True

    async def add_memory(self, user_id: str, messages: list, session_id: str | None = None) -> None:
        items = []
        for message in messages or []:
            text = message_text(message)
            if text.strip():
                items.append({"role": str(_get(message, "role") or "user"), "content": text})
        if items:
            await asyncio.to_thread(self._require().add, user_id, messages=items, session_id=session_id)

    async def search_memory(self, user_id: str, messages: list, filters: dict | None = None) -> list:
        """Memories matching the last message's text; filters: top_k plus the store's search filters."""
        if not messages:
            return []
        query = message_text(messages[-1])
        if not query.strip():
            return []
        filters = dict(filters or {})
        top_k = filters.pop("top_k", self._default_top_k)
        min_score = filters.pop("min_score", None)
        hits = await asyncio.to_thread(
            self._require().search, user_id, query, top_k=top_k, filters=filters or None, min_score=min_score
        )
        return [_to_message(hit.memory, hit.score) for hit in hits]

    async def list_memory(self, user_id: str, filters: dict | None = None) -> list:
        """One page of memories, newest first; filters: page_num (from 1), page_size (default 10)."""
        filters = dict(filters or {})
        unknown = sorted(set(filters) - set(_PAGING_KEYS))
        if unknown:
            raise InvalidMemoryInput(
                f"unknown list_memory filter(s) {unknown}; supported: {list(_PAGING_KEYS)}"
            )
        page = await asyncio.to_thread(
            self._require().list,
            user_id,
            page=filters.get("page_num", 1),
            page_size=filters.get("page_size", 10),
        )
        return [_to_message(m) for m in page.items]

    async def delete_memory(self, user_id: str, session_id: str | None = None) -> None:
        store = self._require()
        if session_id:
            await asyncio.to_thread(store.delete_session, user_id, session_id)
        else:
            await asyncio.to_thread(store.delete_user, user_id)
