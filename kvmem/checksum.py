"""The one checksum of a file's bytes that kvmem's manifests name: KV item tensor files, adapter weights and
configs (the registry's and those vLLM is handed). Knows nothing of what the file holds."""

from __future__ import annotations

import hashlib
import os


def file_sha256(path: str | os.PathLike) -> str:
    """The sha256 hex of the file's bytes, streamed (never read whole). Raises OSError."""
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()
