"""Write receipts (a keyed write's answer, kvmem/text/keyed_writes.py) on both backends: recorded in the write's
own transaction, found by another store object over the same database (another replica), and a repeat that
commits second is rolled back whole."""

from __future__ import annotations

import pytest

from kvmem.text.keyed_writes import Receipt, ReceiptClaim, ReceiptTaken, TxView
from tests.kvmem.text.conftest import open_store


def _added(view: TxView) -> tuple[int, dict]:
    ids = view.event_ids("added", "alice")
    return 201, {"memories": [view.memory("alice", i).to_dict() for i in ids]}


def _claim(key: str, now_s: float = 100.0, fingerprint: str = "f1") -> ReceiptClaim:
    return ReceiptClaim("alice", "POST /v1/memories", key, fingerprint, _added, now_s=now_s, ttl_s=60.0)


def test_a_receipt_is_committed_with_its_write_and_found_by_another_store(store, store_location) -> None:
    with store.keyed_write(_claim("k1")) as claim:
        [memory] = store.add("alice", "I live in Lisbon.", tags=["home"], metadata={"n": 1.5})
    assert claim.receipt == Receipt("f1", 201, {"memories": [memory.to_dict()]})
    other = open_store(store_location)
    try:
        found = other.find_receipt("alice", "POST /v1/memories", "k1", 159.0, 60.0)
        assert found == claim.receipt
        assert other.find_receipt("bob", "POST /v1/memories", "k1", 159.0, 60.0) is None
        assert other.find_receipt("alice", "DELETE /v1/memories", "k1", 159.0, 60.0) is None
        assert other.find_receipt("alice", "POST /v1/memories", "k1", 160.5, 60.0) is None  # expired
        with pytest.raises(ReceiptTaken) as taken, other.keyed_write(_claim("k1", 120.0, "f2")):
            other.add("alice", "I live in Porto.")  # a repeat whose look-up missed the first: rolled back
        assert taken.value.receipt == claim.receipt
        assert [m.text for m in other.list("alice").items] == ["I live in Lisbon."]
        with other.keyed_write(_claim("k1", 161.0)) as late:  # past the TTL the key is free again
            other.add("alice", "I moved to Porto.")
        assert late.receipt is not None and late.receipt.body["memories"][0]["text"] == "I moved to Porto."
        assert store.find_receipt("alice", "POST /v1/memories", "k1", 162.0, 60.0) == late.receipt
        assert other.prune_receipts(221.5) == 1
        assert store.find_receipt("alice", "POST /v1/memories", "k1", 162.0, 60.0) is None
    finally:
        other.close()


def test_a_failed_write_records_no_receipt(store) -> None:
    with pytest.raises(ValueError), store.keyed_write(_claim("k2")) as claim:
        store.add("alice", "")  # refused before any transaction
    assert claim.receipt is None
    broken = _claim("k3")
    broken.answer = lambda view: 1 / 0  # the answer fails inside the transaction: the write is rolled back
    with pytest.raises(ZeroDivisionError), store.keyed_write(broken):
        store.add("alice", "I like tea.")
    assert (
        store.count("alice") == 0
        and store.find_receipt("alice", "POST /v1/memories", "k3", 100.0, 60.0) is None
    )
