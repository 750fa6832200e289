"""Storage failures the server can name: a full disk, a read-only data dir, an unopenable store file (a
PostgreSQL store's outage is kvmem.text.StoreUnavailable, answered 503 by app.py as any dependency's).

Owns recognising them in an exception (`storage_failure`, answered 507 `insufficient_storage` by app.py's
error mapping), the degraded state /health reports until a write succeeds again (StorageHealth), and opening
the store at startup with an error naming the path and the cause (`open_store`). Knows nothing of routes.
"""

from __future__ import annotations

import errno
import sqlite3
import tempfile
import threading
from pathlib import Path

from kvmem.text import MemoryStore, TextStoreConfig
from kvmem.text.db.dialect import is_postgres_url

_SQLITE_STORAGE = {  # sqlite3 messages that mean the disk, not the request
    "database or disk is full": "the disk is full",
    "attempt to write a readonly database": "the store is read-only",
    "disk i/o error": "a disk I/O error",
    "unable to open database file": "the store file cannot be opened",
}
_OS_STORAGE = {
    errno.ENOSPC: "the disk is full",
    errno.EDQUOT: "the disk quota is exceeded",
    errno.EROFS: "the file system is read-only",
    errno.EIO: "a disk I/O error",
}


class StorageUnavailable(RuntimeError):
    """The memory store cannot be opened (startup): the message names the path and the cause."""


def storage_failure(exc: BaseException) -> str | None:
    """What failed, when `exc` (or an exception it was raised from) is a storage failure; else None."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, sqlite3.Error):
            text = str(current).lower()
            for needle, what in _SQLITE_STORAGE.items():
                if needle in text:
                    return f"{what} ({type(current).__name__}: {current})"
        if isinstance(current, OSError) and current.errno in _OS_STORAGE:
            where = f" {current.filename}" if current.filename else ""
            return f"{_OS_STORAGE[current.errno]} (OSError{where}: {current.strerror})"
        current = current.__cause__ or current.__context__
    return None


class StorageHealth:
    """The last storage failure, until a write succeeds. Thread-safe (store subscribers run on worker
    threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._error: str | None = None

    @property
    def error(self) -> str | None:
        with self._lock:
            return self._error

    def failed(self, what: str) -> None:
        with self._lock:
            self._error = what

    def recovered(self, *_event: object) -> None:
        """A write succeeded (usable as a store subscriber)."""
        with self._lock:
            self._error = None


def _cause(path: Path, exc: BaseException) -> str:
    """Why `path` (the store file) cannot be opened: the first real reason found on disk, else `exc`."""
    for parent in (path.parent, *path.parent.parents):
        if parent.exists():
            if not parent.is_dir():
                return f"{parent} is a file, not a directory"
            break
    if path.is_dir():
        return f"{path} is a directory, not a database file"
    if path.parent.is_dir():
        try:
            with tempfile.NamedTemporaryFile(dir=path.parent, prefix=".kvmem-probe-"):
                pass
        except OSError as e:
            return f"the data dir {path.parent} is not writable ({e.strerror})"
    return storage_failure(exc) or f"{type(exc).__name__}: {exc}"


def open_store(path: Path | str, config: TextStoreConfig) -> MemoryStore:
    """The store at `path`, its directory made if needed. Raises StorageUnavailable naming `path` and the
    cause (a file where a directory should be, a read-only data dir, a full disk, ...). `path` may be a
    postgresql:// URL: then an unreachable server raises kvmem.text.StoreUnavailable, naming PostgreSQL
    and its host:port (never the password)."""
    if is_postgres_url(path):
        return MemoryStore(path, config=config)
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return MemoryStore(path, config=config)
    except (OSError, sqlite3.Error) as e:
        raise StorageUnavailable(f"cannot open the memory store {path}: {_cause(path, e)}") from e
