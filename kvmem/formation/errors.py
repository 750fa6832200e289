"""The one exception memory formation raises at its boundary: an extractor could not produce facts.

Knows nothing of how the caller retries; `transient` only says whether trying the same turns again later can
succeed (a timeout, a 5xx, a 429) or cannot (a rejected request, a reply that is not JSON even after repair).
"""

from __future__ import annotations

from kvmem.errors import KvmemError


class ExtractionError(KvmemError):
    """Facts could not be extracted from a batch of turns."""

    def __init__(self, message: str, transient: bool) -> None:
        super().__init__(message)
        self.message = message
        self.transient = transient

    def __repr__(self) -> str:
        return f"ExtractionError({self.message!r}, transient={self.transient})"
