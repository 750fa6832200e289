"""The one exception memory formation raises at its boundary: an extractor could not produce facts.

Knows nothing of how the caller retries; `transient` only says whether trying the same turns again later can
succeed (a timeout, a 5xx, a 429) or cannot (a rejected request, a reply that is not JSON even after repair).
`kind` names the failure in a few words that never quote a turn or a reply ("http_503", "timeout",
"malformed_reply"): what unauthenticated views (/health) and logs may show. The message may quote the reply,
which may repeat what a user said: it is kept with that user's turns only.
"""

from __future__ import annotations

from kvmem.errors import KvmemError


class ExtractionError(KvmemError):
    """Facts could not be extracted from a batch of turns."""

    def __init__(self, message: str, transient: bool, kind: str = "extractor_error") -> None:
        super().__init__(message)
        self.message = message
        self.transient = transient
        self.kind = kind

    def __repr__(self) -> str:
        return f"ExtractionError({self.message!r}, transient={self.transient}, kind={self.kind!r})"
