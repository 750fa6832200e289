"""Exceptions raised at kvmem's public boundaries.

Callers on the request path catch `KVItemError` (and subclasses) and fall back to plaintext injection;
the CLI maps `KvmemError` to exit code 1 with a one-line message.
"""


class KvmemError(Exception):
    """Base of every error kvmem raises on purpose."""


class ModelLoadError(KvmemError):
    """A model could not be loaded: unknown path, unreadable files, bad dtype."""


class ProvisionError(KvmemError):
    """The default model could not be provisioned (download, conversion, unwritable cache dir)."""


class KVItemError(KvmemError):
    """A KV item cannot be served; the caller falls back to plaintext injection."""


class KVItemNotFound(KVItemError):
    """No item with that id in any tier."""


class KVItemCorrupt(KVItemError):
    """The item's files are truncated, unreadable, or fail their checksum."""


class FingerprintMismatch(KVItemError):
    """The item was produced by a different model, tokenizer, dtype, template, layout or RoPE config."""


class InvalidBlock(KvmemError, ValueError):
    """A block cannot be built: empty, or longer than the model's context."""


class DependencyUnavailable(KvmemError):
    """A service kvmem was configured to use (Redis, PostgreSQL) cannot be reached. `dependency` names it,
    `where` is its host:port (never a password); serving answers 503 `dependency_unavailable`."""

    def __init__(self, dependency: str, where: str, reason: str) -> None:
        super().__init__(f"{dependency} at {where} is unreachable: {reason}")
        self.dependency, self.where, self.reason = dependency, where, reason


def url_where(url: str) -> str:
    """host:port of a service URL, for messages (user names and passwords left out)."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
        host, port = parts.hostname or "localhost", parts.port
    except ValueError:
        return "(unparsable URL)"
    return f"{host}:{port}" if port is not None else host


class StorageError(KvmemError):
    """Writing to the data dir failed (unwritable, disk full); nothing already stored was changed."""
