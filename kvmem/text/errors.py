"""Exceptions raised at the plaintext store's public boundary.

Owns the error types only; the serving layer maps them to HTTP statuses (InvalidMemoryInput -> 400,
MemoryNotFound -> 404, StoreUnavailable -> 503) and knows nothing else about them.
"""

from __future__ import annotations

from kvmem.errors import DependencyUnavailable


class TextStoreError(Exception):
    """Base class of every error the plaintext store raises on purpose."""


class InvalidMemoryInput(TextStoreError, ValueError):
    """A caller passed something the store refuses (empty text, a malformed filter, ...); nothing was written."""


class StaleFormation(TextStoreError):
    """A formation pass's decisions were made against a user's memories that changed before its commit (an
    edit, a delete, another write): nothing was written; the turns stay pending for a pass over what is
    there now."""


class MemoryNotFound(TextStoreError, KeyError):
    """No live memory with this id belongs to this user (absent, deleted, or another user's)."""

    def __init__(self, memory_id: str, user_id: str) -> None:
        super().__init__(memory_id)
        self.memory_id = memory_id
        self.user_id = user_id

    def __str__(self) -> str:
        return f"memory {self.memory_id!r} not found for user {self.user_id!r}"


class EmbedderMismatch(TextStoreError):
    """The store file holds vectors from a different embedder than the one it was opened with."""


class SubscriberError(TextStoreError):
    """A change-event subscriber raised. The write itself was committed; every subscriber was still called."""


class StoreUnavailable(TextStoreError, DependencyUnavailable):
    """The database server the store uses cannot be reached (at start, or mid-call: nothing of the call was
    committed). `dependency` names it ("postgresql"), `where` its host:port; the message holds no password.
    A kvmem.errors.DependencyUnavailable, so serving answers 503 `dependency_unavailable`; the store's next
    call reconnects by itself."""


class RerankerLoadError(TextStoreError, ValueError):
    """A reranker could not be built: weights missing, corrupt, or fitted on another feature set."""


class RerankerUnavailable(TextStoreError):
    """A reranker could not score this query (its endpoint failed); search keeps the first-stage order."""
