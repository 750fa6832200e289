"""Write receipts: the answer a keyed write gave (an HTTP `Idempotency-Key`), kept in the store's own database
and written in that write's own transaction, so a repeat through any replica finds it and writes nothing.

Owns the `write_receipts` table's statements and `ReceiptClaim`, which a caller hands to Database.receipt:
the next write transaction of that thread records the claim just before its COMMIT (the answer computed from
what the transaction did, read through its own connection), or finds a live receipt of the same key and rolls
back (ReceiptTaken). Receipts expire after a TTL the caller gives. Knows nothing of HTTP or of the writes.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvmem.text.db.rows import find_live, to_json
from kvmem.text.errors import TextStoreError
from kvmem.text.records import ChangeEvent, Memory


@dataclass(frozen=True)
class Receipt:
    """A recorded answer: the fingerprint of the request that made it, its status and its JSON body."""

    fingerprint: str
    status: int
    body: dict[str, Any]


class ReceiptTaken(TextStoreError):
    """A live receipt for this key was recorded meanwhile (another replica or thread ran the same keyed write
    first): this write was rolled back, and `receipt` is the first one's."""

    def __init__(self, receipt: Receipt) -> None:
        super().__init__("a write with this key was already committed")
        self.receipt = receipt


@dataclass(frozen=True)
class TxView:
    """What an answer may read of the transaction it is recorded in: its change events and its memories."""

    conn: Any
    events: Sequence[ChangeEvent]

    def memory(self, user_id: str, memory_id: str) -> Memory | None:
        """The live memory as this transaction leaves it; None if deleted or absent."""
        found = find_live(self.conn, user_id, memory_id)
        return None if found is None else found.memory

    def event_ids(self, kind: str, user_id: str) -> list[str]:
        """The ids of this user's memories the transaction changed with `kind`, in event order, once each."""
        return list(
            dict.fromkeys(e.memory_id for e in self.events if e.kind == kind and e.user_id == user_id)
        )


@dataclass
class ReceiptClaim:
    """A keyed write's claim: `answer(view)` -> (status, body) is computed and recorded in the first write
    transaction that commits inside Database.receipt; `receipt` is set once that transaction committed."""

    user_id: str
    scope: str  # what the key is scoped to besides the user (the HTTP method and path)
    key: str
    fingerprint: str
    answer: Callable[[TxView], tuple[int, dict[str, Any]]]
    now_s: float  # wall-clock seconds (time.time: replicas compare it)
    ttl_s: float
    receipt: Receipt | None = field(default=None)


def find_receipt(conn: Any, user_id: str, scope: str, key: str, now_s: float, ttl_s: float) -> Receipt | None:
    """The live receipt of (user, scope, key): recorded less than `ttl_s` before `now_s`; else None."""
    row = conn.execute(
        "SELECT fingerprint, status, body FROM write_receipts "
        "WHERE user_id = ? AND scope = ? AND key = ? AND stored_at >= ?",
        (user_id, scope, key, now_s - ttl_s),
    ).fetchone()
    return None if row is None else Receipt(row[0], int(row[1]), json.loads(row[2]))


def record_receipt(conn: Any, claim: ReceiptClaim, events: Sequence[ChangeEvent]) -> Receipt:
    """Inside the write's transaction, before COMMIT: raises ReceiptTaken if a live receipt of the key exists
    (the caller rolls back), else computes the claim's answer and stores it (over an expired one)."""
    taken = find_receipt(conn, claim.user_id, claim.scope, claim.key, claim.now_s, claim.ttl_s)
    if taken is not None:
        raise ReceiptTaken(taken)
    status, body = claim.answer(TxView(conn, tuple(events)))
    receipt = Receipt(claim.fingerprint, status, body)
    conn.execute(
        "INSERT INTO write_receipts (user_id, scope, key, fingerprint, status, body, stored_at) "
        "VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (user_id, scope, key) DO UPDATE SET "
        "fingerprint = excluded.fingerprint, status = excluded.status, body = excluded.body, "
        "stored_at = excluded.stored_at",
        (claim.user_id, claim.scope, claim.key, claim.fingerprint, status, to_json(body), claim.now_s),
    )
    return receipt


def amend_receipt(conn: Any, claim: ReceiptClaim, body: dict[str, Any]) -> None:
    """Replace a recorded receipt's body (a post-commit hook's warning, added after the write's commit)."""
    conn.execute(
        "UPDATE write_receipts SET body = ? WHERE user_id = ? AND scope = ? AND key = ?",
        (to_json(body), claim.user_id, claim.scope, claim.key),
    )


def prune_receipts(conn: Any, before_s: float) -> int:
    """Deletes every receipt recorded before `before_s`; returns how many."""
    return conn.execute("DELETE FROM write_receipts WHERE stored_at < ?", (before_s,)).rowcount
