"""kvmem.text: the plaintext memory store (SQLite, WAL; or PostgreSQL), hybrid keyword + dense search, change events.

Every memory lives here first; whatever no faster tier serves is injected from here as text. Knows nothing
of HTTP, KV items or scheduling policy.
"""

from kvmem.text.config import TextStoreConfig
from kvmem.text.errors import (
    EmbedderMismatch,
    InvalidMemoryInput,
    MemoryNotFound,
    RerankerLoadError,
    RerankerUnavailable,
    StoreUnavailable,
    SubscriberError,
    TextStoreError,
)
from kvmem.text.filters import SearchFilters, TimeRange
from kvmem.text.records import (
    ChangeEvent,
    CommitResult,
    FormationCounts,
    FormedMemory,
    Memory,
    MemoryVersion,
    Page,
    SearchHit,
    Turn,
    TurnPage,
)
from kvmem.text.search.embedders import (
    Embedder,
    HashEmbedder,
    OnnxMiniLMEmbedder,
    SentenceTransformerEmbedder,
    default_embedder,
    load_embedder,
)
from kvmem.text.search.rerank import Reranker
from kvmem.text.store import MemoryStore

__all__ = [
    "ChangeEvent",
    "CommitResult",
    "Embedder",
    "EmbedderMismatch",
    "FormationCounts",
    "FormedMemory",
    "HashEmbedder",
    "InvalidMemoryInput",
    "Memory",
    "MemoryNotFound",
    "MemoryStore",
    "MemoryVersion",
    "OnnxMiniLMEmbedder",
    "Page",
    "Reranker",
    "RerankerLoadError",
    "RerankerUnavailable",
    "SearchFilters",
    "SearchHit",
    "SentenceTransformerEmbedder",
    "StoreUnavailable",
    "SubscriberError",
    "TextStoreConfig",
    "TextStoreError",
    "TimeRange",
    "Turn",
    "TurnPage",
    "default_embedder",
    "load_embedder",
]
