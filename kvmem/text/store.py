"""MemoryStore: every memory of every user, in one SQLite file (WAL) or one PostgreSQL database (a
`postgresql://` URL: several replicas share it), with hybrid search and change events.

Owns opening the store and its writes (add, update, import): checks (filters.py), then one transaction
(db.py) of row statements (rows.py), so a failure writes nothing and a returned write is durable; then the
in-process caches are brought in step. Subscribers hear (memory id, user, added/updated/deleted) after the
commit and before the call returns (DESIGN invariant 5). The reads and search (reads.py), the conversation
log's calls (log.py), formation's writes and supersession (formed.py) and deletes (deletes.py) are mixed in;
ranking, dumps and embedder bookkeeping live in search.py, jsonl.py, store_embeddings.py. Every query carries
the user id, so no call returns another user's memory. Knows nothing of HTTP, KV items or scheduling.
"""

from __future__ import annotations

import io
import logging
import os
import sqlite3
import uuid
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import IO

import numpy as np

from kvmem.text.config import TextStoreConfig
from kvmem.text.conversation.formed import FormationWrites
from kvmem.text.conversation.log import ConversationLog
from kvmem.text.db.connections import Database
from kvmem.text.db.dialect import is_postgres_url
from kvmem.text.db.rows import bump_generation, find_live, insert_memory, write_version
from kvmem.text.db.schema import migrate
from kvmem.text.deletes import MemoryDeletes
from kvmem.text.errors import InvalidMemoryInput, MemoryNotFound, RerankerLoadError
from kvmem.text.filters import (
    check_memory_id,
    check_metadata,
    check_optional_id,
    check_slots,
    check_tags,
    check_text,
    check_user_id,
    format_time,
    parse_add_items,
)
from kvmem.text.jsonl import ON_CONFLICT, export_jsonl, import_jsonl
from kvmem.text.keyed_writes import KeyedWrites
from kvmem.text.reads import MemoryReads
from kvmem.text.records import ChangeEvent, Memory
from kvmem.text.search.bm25 import num_tokens
from kvmem.text.search.embedders import Embedder, default_embedder
from kvmem.text.search.rerank import Reranker, build_reranker
from kvmem.text.search.rerank_features import speaker_of
from kvmem.text.search.vectors import VectorCache
from kvmem.text.store_embeddings import TextVectorCache, embed_query, embed_texts, reconcile_embedder

logger = logging.getLogger(__name__)


class MemoryStore(MemoryReads, ConversationLog, FormationWrites, MemoryDeletes, KeyedWrites):
    """The plaintext memory store. Thread-safe: a database connection per thread, writes serialized by a lock
    (across processes too). `path`: a SQLite file, or a `postgresql://user@host:port/db` URL (same behaviour;
    StoreUnavailable when the server cannot be reached, and the next call reconnects).

        Served memories (active, not superseded) are what search, list and memories_by_ids return by default;
        `get` and `count` also see superseded ones. The reads (get, list, search, ...), the conversation log
        (log_turns, ...) and formation's writes (commit_formed, supersede, slot_candidates) and deletes with
        their cascade to the log (delete, delete_session, delete_user) and keyed writes' receipts
        (find_receipt, keyed_write, ...) come from the mixins MemoryReads, ConversationLog, FormationWrites,
        MemoryDeletes and KeyedWrites.

        Raises InvalidMemoryInput for bad arguments (nothing written), MemoryNotFound for an id that is not a
        live memory of this user, SubscriberError if a subscriber raised (the write stands).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        embedder: Embedder | None = None,
        config: TextStoreConfig | None = None,
        *,
        clock: Callable[[], datetime] | None = None,
    ) -> None:
        is_url = is_postgres_url(path)
        # The SQLite file; None on PostgreSQL (`location` names either, without a password).
        self.path: Path | None = None if is_url else Path(path)
        self.config = config or TextStoreConfig()
        self.embedder: Embedder = embedder if embedder is not None else default_embedder()
        self._clock = clock or (lambda: datetime.now(timezone.utc))
        # The PostgreSQL database's URL (what other tables of this deployment, heat, share); None on SQLite.
        self.database_url: str | None = path if is_url else None
        self._db = Database(path if is_url else self.path, self.config)
        self.location = self._db.describe()
        self._vectors = VectorCache(self.config.vector_cache_bytes)
        self._query_cache = TextVectorCache()  # memory vectors of single texts
        self._query_vectors = TextVectorCache()  # query vectors (the query head's), never stored
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        migrate(self._conn())
        self._check_embedder()
        self._rerankers: dict[tuple, Reranker | None] = {}
        self._reranker()  # a bad weights file is refused (and logged) when the store opens, not mid-search

    # ----------------------------------------------------------------- connections and events

    def _conn(self) -> sqlite3.Connection:  # or pg.PgConnection, which takes the same statements
        """This thread's connection (tests and single statements outside a transaction use it)."""
        return self._db.conn()

    def close(self) -> None:
        """Closes every connection this store opened; later calls raise TextStoreError."""
        self._db.close()
        self._vectors.clear()

    def __enter__(self) -> MemoryStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def subscribe(self, callback: Callable[[ChangeEvent], None]) -> Callable[[], None]:
        """Calls `callback(event)` for every change, synchronously after commit; returns an unsubscribe."""
        return self._db.subscribe(callback)

    # ----------------------------------------------------------------- embeddings

    def _check_embedder(self) -> None:
        name, dim = self.embedder.name, int(self.embedder.dim)
        with self._db.write() as tx:
            reconcile_embedder(
                tx.conn, self.location, name, dim, self._embed, self.config.reembed_on_mismatch
            )

    def _embed(self, texts: list[str]) -> np.ndarray:
        """Vectors for texts, [n, dim] float32 (see embedding.embed_texts)."""
        return embed_texts(self.embedder, texts, self._query_cache)

    def _embed_query(self, text: str) -> np.ndarray:
        """The vector a search for `text` ranks by, [dim] float32 (see store_embeddings.embed_query)."""
        return embed_query(self.embedder, text, self._query_cache, self._query_vectors)

    def _reranker(self) -> Reranker | None:
        """The second stage the current config names, built once per (name, weights, endpoint); None for
        'none', or when it was refused: then a log line says why and hybrid search keeps the first stage."""
        config = self.config
        key = (config.rerank, config.rerank_weights, config.rerank_llm_url, config.rerank_llm_model)
        if key not in self._rerankers:
            try:
                self._rerankers[key] = build_reranker(*key)
            except RerankerLoadError as exc:
                logger.error("reranker %r refused: %s; hybrid search uses the first-stage order", key[0], exc)
                self._rerankers[key] = None
        return self._rerankers[key]

    # ----------------------------------------------------------------- add

    def add(
        self,
        user_id: str,
        text: str | None = None,
        *,
        texts: list[str] | None = None,
        messages: list[dict] | None = None,
        session_id: str | None = None,
        agent_id: str | None = None,
        chat_time: str | datetime | None = None,
        tags: list[str] | None = None,
        metadata: dict | None = None,
        slots: list[tuple[str, str] | None] | None = None,
    ) -> list[Memory]:
        """Stores one text, a list of texts, or chat messages (one memory each, keeping role and chat_time).

        chat_time defaults to now; a message's own chat_time wins over the call's; valid_from is chat_time
        and source 'api'. slots: one (slot, value) or None per memory added (what later memories about the
        same slot may supersede). One transaction.
        """
        check_user_id(user_id)
        check_optional_id(session_id, "session_id")
        check_optional_id(agent_id, "agent_id")
        items = parse_add_items(
            text, texts, messages, chat_time, self.config.max_text_tokens, self.config.max_text_chars
        )
        tag_tuple = check_tags(tags)
        metadata = check_metadata(metadata)
        slot_pairs = check_slots(slots, len(items))
        vectors = self._embed([item.text for item in items])
        now = format_time(self._clock())
        memories = [
            Memory(
                id=uuid.uuid4().hex,
                user_id=user_id,
                session_id=session_id,
                agent_id=agent_id,
                role=role,
                text=body,
                created_at=now,
                chat_time=when or now,
                updated_at=now,
                tags=tag_tuple,
                metadata=metadata,
                state="active",
                version=1,
                valid_from=when or now,
                slot=slot[0] if slot else None,
                slot_value=slot[1] if slot else None,
            )
            for (role, body, when), slot in zip(items, slot_pairs, strict=True)
        ]
        with self._db.write(user_id) as tx:
            rowids = [
                self._insert(tx.conn, memory, vector.tobytes())
                for memory, vector in zip(memories, vectors, strict=False)
            ]
            gen = bump_generation(tx.conn, user_id)
            rowid_array = np.asarray(rowids, dtype=np.int64)
            sessions = [session_id] * len(memories)
            speakers = [speaker_of(m.role, m.metadata) for m in memories]
            texts = [m.text for m in memories]
            lengths = [num_tokens(text) for text in texts]
            tx.after_commit.append(
                lambda: self._vectors.append(
                    user_id, gen - 1, gen, rowid_array, vectors, sessions, speakers, lengths, texts
                )
            )
            tx.events.extend(ChangeEvent(m.id, user_id, "added") for m in memories)
        return memories

    # add's and import's insert path (rows.insert_memory); a class attribute, so tests can make it fail mid-batch.
    _insert = staticmethod(insert_memory)

    # ----------------------------------------------------------------- update

    def update(
        self,
        user_id: str,
        memory_id: str,
        *,
        text: str | None = None,
        tags: list[str] | None = None,
        metadata: dict | None = None,
        state: str | None = None,
        slot: tuple[str, str] | None = None,
    ) -> Memory:
        """A new version with the given fields replaced; the previous text, tags and metadata go to history.

        state may be 'active' or 'archived' (archived memories are not searched). slot: with a new `text`, that
        text's (slot, value) as add takes it, or None for none: a new text never keeps the old one's slot (a
        later memory about the old slot would supersede this one); ignored when the text does not change.
        Nothing changed: no new version, no event.
        """
        check_user_id(user_id)
        check_memory_id(memory_id)
        if text is None and tags is None and metadata is None and state is None:
            raise InvalidMemoryInput("update needs at least one of text, tags, metadata or state")
        if text is not None:
            check_text(text, self.config.max_text_tokens, self.config.max_text_chars)
        if state is not None and state not in ("active", "archived"):
            raise InvalidMemoryInput(
                f"state must be 'active' or 'archived' (use delete to delete), got {state!r}"
            )
        new_tags = check_tags(tags) if tags is not None else None
        new_metadata = check_metadata(metadata) if metadata is not None else None
        [new_slot] = check_slots([slot], 1)
        vector = self._embed([text])[0] if text is not None else None
        with self._db.write(user_id) as tx:
            found = find_live(tx.conn, user_id, memory_id)
            if found is None:
                raise MemoryNotFound(memory_id, user_id)
            rowid, old = found
            new = Memory(
                **{
                    **old.__dict__,
                    "text": text if text is not None else old.text,
                    "tags": new_tags if new_tags is not None else old.tags,
                    "metadata": new_metadata if new_metadata is not None else old.metadata,
                    "state": state if state is not None else old.state,
                }
            )
            if new.text != old.text:
                new = Memory(
                    **{
                        **new.__dict__,
                        "slot": new_slot[0] if new_slot else None,
                        "slot_value": new_slot[1] if new_slot else None,
                    }
                )
            if new == old:
                return old
            new = Memory(
                **{
                    **new.__dict__,
                    "version": old.version + 1,
                    "updated_at": max(format_time(self._clock()), old.updated_at),
                }
            )
            write_version(tx.conn, rowid, old, new, vector)
            said = new.text != old.text or new.state != old.state
            # the cached rows (vectors.UserVectors) hold each row's speaker, read from the metadata first
            speaker_moved = speaker_of(new.role, new.metadata) != speaker_of(old.role, old.metadata)
            if said or speaker_moved:
                bump_generation(tx.conn, user_id)
                tx.after_commit.append(lambda: self._vectors.invalidate(user_id))
            tx.events.append(ChangeEvent(memory_id, user_id, "updated", text_changed=said))
        return new

    # ----------------------------------------------------------------- export and import

    def export_jsonl(self, fp_or_path: str | os.PathLike | IO[str], user_id: str | None = None) -> int:
        """Writes live memories (one user's, or all) as JSON lines with history and vectors; returns how many."""
        if user_id is not None:
            check_user_id(user_id)
        return export_jsonl(self._db, self.embedder.name, fp_or_path, user_id)

    def import_jsonl(
        self, fp_or_path: str | os.PathLike | IO[str], progress: bool = False, on_conflict: str = "error"
    ) -> int:
        """Loads a dump in one transaction (all or nothing); returns how many memories were added.

        Vectors of the same embedder are reused, others recomputed. An id already in the file is an
        InvalidMemoryInput (on_conflict='error') or left alone (on_conflict='skip').
        """
        if on_conflict not in ON_CONFLICT:
            raise InvalidMemoryInput(f"on_conflict must be 'error' or 'skip', got {on_conflict!r}")
        return import_jsonl(
            self._db,
            self.embedder,
            self._vectors,
            fp_or_path,
            embed_batch_size=self.config.embed_batch_size,
            progress=progress,
            on_conflict=on_conflict,
            insert=self._insert,
        )


def dumps_jsonl(store: MemoryStore, user_id: str | None = None) -> str:
    """A dump as one string (small stores, tests)."""
    buffer = io.StringIO()
    store.export_jsonl(buffer, user_id)
    return buffer.getvalue()
