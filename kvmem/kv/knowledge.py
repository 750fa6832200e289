"""Shared knowledge: a deployment's texts (FAQ, manual, policies) served at the head of every user's block.

`kvmem build --knowledge FILE` installs the texts in DATA_DIR/knowledge/knowledge.json (atomically) and builds
the knowledge item: the K/V of `PromptLayout.knowledge_ids` (system opening + system prompt + knowledge), owned
by no user (`KNOWLEDGE_OWNER`, an id no user can have), so a user's delete never touches it. Each user's block
is then a child item (KVItemMeta.parent_id): its file, and its copy in every store tier, hold only the user's
own tokens' K/V; the store attaches the parent (resident once) to the child it returns, and a request's
injection joins the two into the request's own cache (kvmem/kv/inject.py). The child's content address covers the knowledge (its token ids start
with the knowledge's), so when the knowledge changes no old child is ever looked up again, hence never served.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from kvmem.errors import KVItemError, KvmemError
from kvmem.kv.item import KVItem, item_id_for
from kvmem.kv.prefill import build_item

if TYPE_CHECKING:
    from kvmem.kv.layout import PromptLayout
    from kvmem.kv.store import TieredKVStore

KNOWLEDGE_OWNER = ""  # the text store refuses empty user ids: no user can name (or delete) this item


class KnowledgeFileError(KvmemError, ValueError):
    pass


def parse_knowledge_file(path: str | os.PathLike) -> list[str]:
    """Texts one per line; a line that is JSON is a string or {"text": str}. Blank lines are skipped.
    Raises KnowledgeFileError naming the line."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise KnowledgeFileError(f"knowledge file {str(path)!r} cannot be read: {exc}") from exc
    texts = []
    for n, raw in enumerate(lines, start=1):
        line = raw.strip()
        if not line:
            continue
        if line[0] in '{"':
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise KnowledgeFileError(f"knowledge file line {n}: not valid JSON ({exc.msg})") from exc
            text = obj.get("text") if isinstance(obj, dict) else obj
            if not isinstance(text, str) or not text.strip():
                raise KnowledgeFileError(f"knowledge file line {n}: expected a string or {{'text': str}}")
            line = text
        texts.append(line)
    if not texts:
        raise KnowledgeFileError(f"knowledge file {str(path)!r} has no texts")
    return texts


def knowledge_path(data_root: str | os.PathLike) -> Path:
    return Path(data_root) / "knowledge" / "knowledge.json"


def install(data_root: str | os.PathLike, texts: Sequence[str]) -> None:
    """Make `texts` the deployment's knowledge (servers started afterwards serve it)."""
    path = knowledge_path(data_root)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps({"texts": list(texts)}, ensure_ascii=False))
    os.replace(tmp, path)


def installed_stamp(data_root: str | os.PathLike) -> tuple[int, int, int] | None:
    """A cheap identity of the installed knowledge (one stat): `install` replaces the file, so it changes
    with every install. None when none is installed."""
    try:
        st = knowledge_path(data_root).stat()
    except FileNotFoundError:
        return None
    return (st.st_ino, st.st_mtime_ns, st.st_size)


def installed(data_root: str | os.PathLike) -> tuple[str, ...]:
    """The installed knowledge; () when none. A malformed file is an error, not silently no knowledge."""
    path = knowledge_path(data_root)
    if not path.is_file():
        return ()
    try:
        texts = json.loads(path.read_text(encoding="utf-8"))["texts"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise KnowledgeFileError(f"installed knowledge {str(path)!r} is unreadable: {exc}") from exc
    if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
        raise KnowledgeFileError(f"installed knowledge {str(path)!r}: 'texts' must be a list of strings")
    return tuple(texts)


def knowledge_item_id(layout: PromptLayout, fingerprint) -> str | None:
    ids = layout.knowledge_ids
    return item_id_for(KNOWLEDGE_OWNER, fingerprint, ids) if ids else None


def ensure_knowledge_item(handle, layout: PromptLayout, store: TieredKVStore) -> KVItem | None:
    """The stored knowledge item for this layout and model, built (prefilled) if missing or unusable;
    None when the layout has no knowledge."""
    item_id = knowledge_item_id(layout, handle.fingerprint)
    if item_id is None:
        return None
    if store.contains(item_id):
        try:
            return store.get(item_id)
        except KVItemError:
            pass  # dropped by the store; rebuilt below
    item = build_item(handle, list(layout.knowledge_ids), user_id=KNOWLEDGE_OWNER)
    store.put(item)
    return item
