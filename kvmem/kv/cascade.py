"""The delete cascade's lookup on disk: which stored KV items were built from given memories of a user.

Reads manifests only (never tensors) and deletes files; the tiered store calls it for items it has not
indexed, and a backend calls `forget_on_disk` before any store is open. Knows nothing of tiers or plans.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path

from kvmem.errors import KVItemError
from kvmem.kv.io import delete_item_files, list_item_ids, read_manifest
from kvmem.kv.item import KVItemMeta


def disk_metas(directory: Path, skip: Iterable[str] = ()) -> dict[str, KVItemMeta]:
    """Metadata of the items whose manifests are in `directory`, except `skip`. Unreadable manifests name no
    one we could match and are left out (check_integrity drops them)."""
    skip = set(skip)
    out = {}
    for item_id in list_item_ids(directory):
        if item_id in skip:
            continue
        try:
            out[item_id] = KVItemMeta.from_dict(read_manifest(directory, item_id)["meta"])
        except KVItemError:
            continue
    return out


def matcher(
    user_id: str, memory_ids: Iterable[str] | None, adapters: Iterable[str] = ()
) -> Callable[[KVItemMeta], bool]:
    """The user's items built from any of `memory_ids` (None: all of them) or under any of the LoRA `adapters`
    (served names: their K/V carry the adapter's facts)."""
    wanted = None if memory_ids is None else set(memory_ids)
    under = set(adapters)
    return lambda m: (
        m.user_id == user_id
        and (wanted is None or not wanted.isdisjoint(m.memory_ids) or m.fingerprint.adapter in under)
    )


def forget_on_disk(
    directory: str | os.PathLike,
    user_id: str,
    memory_ids: Iterable[str] | None = None,
    adapters: Iterable[str] = (),
) -> list[str]:
    """`TieredKVStore.forget` for a directory no store in this process has opened yet: deletes the files of
    every matching item. Returns the ids, sorted."""
    directory = Path(directory)
    match = matcher(user_id, memory_ids, adapters)
    ids = sorted(i for i, m in disk_metas(directory).items() if match(m))
    for item_id in ids:
        delete_item_files(directory, item_id)
    return ids
