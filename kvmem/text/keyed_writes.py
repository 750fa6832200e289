"""Keyed writes, mixed into MemoryStore: a write made under a key records its answer (a receipt) in its own
transaction, so a repeat of the key, through this process or any other sharing the database, finds the first
answer and writes nothing.

Owns the store's calls over db/receipts.py: find a receipt, run writes under a claim, amend a receipt's body,
prune expired receipts. What an answer holds, and what a key is scoped to, are the caller's. Knows nothing of
HTTP.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from kvmem.text.db import receipts
from kvmem.text.db.connections import Database
from kvmem.text.db.receipts import Receipt, ReceiptClaim, ReceiptTaken, TxView
from kvmem.text.filters import check_user_id

__all__ = ["KeyedWrites", "Receipt", "ReceiptClaim", "ReceiptTaken", "TxView"]


class KeyedWrites:
    """The receipt calls on MemoryStore; the store provides `_db`."""

    _db: Database

    def find_receipt(self, user_id: str, scope: str, key: str, now_s: float, ttl_s: float) -> Receipt | None:
        """The receipt recorded for (user, scope, key) less than `ttl_s` before `now_s` (wall-clock seconds)."""
        check_user_id(user_id)
        return receipts.find_receipt(self._db.conn(), user_id, scope, key, now_s, ttl_s)

    @contextmanager
    def keyed_write(self, claim: ReceiptClaim) -> Iterator[ReceiptClaim]:
        """Store writes this thread makes inside the block record `claim`'s receipt in the first write
        transaction that commits (the claim's `answer` computed there). Raises ReceiptTaken, with nothing
        written, if a live receipt of the key was recorded meanwhile."""
        check_user_id(claim.user_id)
        with self._db.receipt(claim):
            yield claim

    def record_receipt(self, claim: ReceiptClaim) -> Receipt:
        """Records `claim` in a transaction of its own (a keyed call that wrote nothing); ReceiptTaken as above."""
        with self._db.receipt(claim), self._db.write(claim.user_id):
            pass
        assert claim.receipt is not None
        return claim.receipt

    def amend_receipt(self, claim: ReceiptClaim, body: dict[str, Any]) -> None:
        """Replaces the body of `claim`'s recorded receipt (a warning learnt after the write committed)."""
        with self._db.write(claim.user_id) as tx:
            receipts.amend_receipt(tx.conn, claim, body)

    def prune_receipts(self, before_s: float) -> int:
        """Deletes the receipts recorded before `before_s`; returns how many. Every user's: it waits for every
        writer (an hourly call)."""
        with self._db.write() as tx:
            return receipts.prune_receipts(tx.conn, before_s)
