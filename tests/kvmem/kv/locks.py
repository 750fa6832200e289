"""Whether a KV store's lock is free right now, asked from another thread (the lock is reentrant, so the
thread holding it could always take it again): the check that slow work runs with the lock released."""

from __future__ import annotations

import threading

from kvmem.kv import TieredKVStore


def lock_is_free(store: TieredKVStore) -> bool:
    free: list[bool] = []

    def try_lock() -> None:
        free.append(store._lock.acquire(blocking=False))
        if free[0]:
            store._lock.release()

    t = threading.Thread(target=try_lock)
    t.start()
    t.join(10)
    return free == [True]
