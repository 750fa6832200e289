"""Which adapter each user is served now, read cheaply on the request path.

`ActiveAdapters.get` costs one `stat` of the user's pointer file when nothing changed (the pointer may be
replaced by another process: `kvmem distill`, an operator's rollback). A version is checked once (its files'
hashes, its base model, its gates) the first time it is seen; one that fails is not served, with the reason
logged once, until the pointer names another version. `peek` is the request path's read: what the last `get`
found, a dict read (no stat, no hash). `check` answers what `get` would, without recording it (reads that only
look must not take the worker's notice of a moved pointer). Both caches hold at most `max_users` users (least recently used
dropped: their next `get` stats and checks again). Knows nothing of plans or serving.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

from kvmem.adapters.manifest import AdapterManifest, FactRef, text_sha
from kvmem.adapters.registry import ACTIVE_FILE, AdapterRegistry

log = logging.getLogger(__name__)

MAX_USERS = 10_000  # users whose served adapter (and version checks) stay cached; LRU past that


class AdapterPeek(NamedTuple):
    manifest: AdapterManifest | None  # what the worker's last check found
    current: bool  # False: the pointer moved (or the cascade dropped the entry) since; the worker checks it


class ActiveAdapters:
    def __init__(
        self,
        registry: AdapterRegistry,
        base_fingerprint: Callable[[], str | None],
        facts_current: Callable[[str, tuple[FactRef, ...]], str | None] | None = None,
        *,
        max_users: int = MAX_USERS,
    ) -> None:
        if max_users < 1:
            raise ValueError(f"ActiveAdapters.max_users must be >= 1, got {max_users!r}")
        self.max_users = max_users
        self.registry = registry
        self._base_fingerprint = base_fingerprint
        self._facts_current = facts_current  # why a version's facts are stale (store read), or None
        self._lock = threading.Lock()
        # user -> (pointer file stamp, the served manifest or None)
        self._cache: OrderedDict[str, tuple[tuple[int, int] | None, AdapterManifest | None]] = OrderedDict()
        # (user, version, sha) -> why not served; LRU-bounded like the cache
        self._checked: OrderedDict[tuple[str, int, str], str | None] = OrderedDict()

    def _stamp(self, user_id: str) -> tuple[int, int] | None:
        try:
            st = os.stat(self.registry.user_dir(user_id) / ACTIVE_FILE)
        except OSError:
            return None
        return st.st_mtime_ns, st.st_ino

    def peek(self, user_id: str) -> AdapterPeek:
        """The request path's read: what the last `get` found for `user_id`, and whether it is `current` (the
        pointer file's stamp is still the one it was found at; no pointer and nothing cached is current too).
        One `stat`, never a registry read or a hash: a pointer that moved is checked by the worker's `get`.
        Never raises."""
        cached = self._cache.get(user_id)
        stamp = self._stamp(user_id)
        if cached is None:
            return AdapterPeek(None, stamp is None)
        return AdapterPeek(cached[1], cached[0] == stamp)

    def cached(self, user_id: str) -> AdapterManifest | None:
        """What the last `get` found (a dict read; None when not asked or dropped from the cache)."""
        cached = self._cache.get(user_id)
        return None if cached is None else cached[1]

    def get(self, user_id: str) -> AdapterManifest | None:
        """The adapter to serve `user_id`, or None: a stat, and on a new version its check (hashes its files).
        Recorded: `peek` is current again until the pointer moves. The worker's read, the one that acts on a
        change (off the request path). Never raises."""
        return self._resolve(user_id, record=True)

    def check(self, user_id: str) -> AdapterManifest | None:
        """What `get` would answer now (a stat, a new version's check), without recording it: `peek` still
        says the pointer moved, so the worker, whose `peek`/`get` notice a move, still acts on it. For reads
        that only look (a plan read, the distillation sweep): had they recorded the new stamp, the worker would
        never see the pointer move and never rebuild the user's block under the new version. Never raises."""
        return self._resolve(user_id, record=False)

    def _resolve(self, user_id: str, *, record: bool) -> AdapterManifest | None:
        stamp = self._stamp(user_id)
        cached = self._cache.get(user_id)
        if cached is not None and cached[0] == stamp:
            if record:
                with self._lock:
                    if user_id in self._cache:
                        self._cache.move_to_end(user_id)
            return cached[1]
        manifest = self.registry.active(user_id) if stamp is not None else None
        if manifest is not None:
            key = (user_id, manifest.version, manifest.sha256)
            if key not in self._checked:
                why = self.registry.verify(manifest, self._base_fingerprint())
                if why is None and self._facts_current is not None:  # e.g. a rollback past a changed memory
                    try:
                        why = self._facts_current(user_id, manifest.facts)
                    except Exception as exc:  # noqa: BLE001 - the store failed: not served now, checked again
                        log.warning(
                            "adapter %s of user %r: its facts could not be checked (%s); not served until "
                            "they are",
                            manifest.name,
                            user_id,
                            type(exc).__name__,
                        )
                        return None
                with self._lock:
                    self._checked[key] = why
                    while len(self._checked) > self.max_users:
                        self._checked.popitem(last=False)
                if why is not None:
                    log.error("adapter %s of user %r not served: %s", manifest.name, user_id, why)
            if self._checked.get(key) is not None:
                manifest = None
        if record:
            with self._lock:
                self._cache[user_id] = (stamp, manifest)
                self._cache.move_to_end(user_id)
                while len(self._cache) > self.max_users:
                    self._cache.popitem(last=False)
        return manifest

    def drop_covering(self, user_id: str, memory_ids: Iterable[str] | None, reason: str) -> bool:
        """The delete cascade: the user's active adapter stops being served before this returns if it holds any
        of `memory_ids` (None: any). True if one was stopped."""
        stopped = self.registry.deactivate_covering(user_id, memory_ids, reason)
        with self._lock:
            self._cache.pop(user_id, None)
            for key in [k for k in self._checked if k[0] == user_id]:  # facts must be checked again
                del self._checked[key]
        return stopped

    def erase_stale(
        self, user_id: str, memory_ids: Iterable[str] | None, reason: str
    ) -> list[AdapterManifest]:
        """The delete cascade on disk: every version of the user's that holds any of `memory_ids` and whose facts
        are no longer all current (None: every version of the user) is erased (`AdapterRegistry.erase`), not
        only unserved; a version trained on a memory's new text stays. Returns the erased manifests (their
        names are what KV items built under them carry)."""
        wanted = None if memory_ids is None else set(memory_ids)
        doomed = [
            m
            for m in self.registry.versions(user_id)
            if wanted is None
            or (
                not wanted.isdisjoint(m.memory_ids)
                and (self._facts_current is None or self._facts_current(user_id, m.facts) is not None)
            )
        ]
        erased = self.registry.erase(user_id, [m.version for m in doomed], reason)
        with self._lock:
            self._cache.pop(user_id, None)
        return erased


def facts_current(store: Any, user_id: str, facts: tuple[FactRef, ...]) -> str | None:
    """Why these facts are not all the store's current memories (deleted or their text changed since), or
    None. A newer version with the same text (its tags or metadata changed) still says the same fact."""
    live = {m.id: m for m in store.memories_by_ids(user_id, [f.memory_id for f in facts])}
    for f in facts:
        m = live.get(f.memory_id)
        if m is None:
            return f"memory {f.memory_id} was deleted"
        if text_sha(m.text) != f.text_sha or getattr(m, "state", "active") != "active":
            return f"memory {f.memory_id} changed"
    return None
