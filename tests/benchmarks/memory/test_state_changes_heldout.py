"""The sealed held-out set of changes of state (benchmarks/data/state_changes): the data matches its committed
sha256, and its rows have the documented shape and counts."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from pathlib import Path

DATA = Path(__file__).resolve().parents[3] / "benchmarks" / "data" / "state_changes"


def test_data_matches_its_sealed_hash() -> None:
    digest, name = (DATA / "heldout.jsonl.sha256").read_text().split()
    assert name == "heldout.jsonl"
    assert hashlib.sha256((DATA / "heldout.jsonl").read_bytes()).hexdigest() == digest


def test_rows_have_the_documented_shape() -> None:
    rows = [json.loads(line) for line in (DATA / "heldout.jsonl").read_text().splitlines()]
    kinds = Counter(r["kind"] for r in rows)
    assert kinds == {"change": 106, "non_change": 109}
    assert len({r["id"] for r in rows}) == len(rows)
    for r in rows:
        assert set(r) == {"id", "kind", "category", "prefix", "turn", "superseded_turn", "old_fact", "new_fact"}
        assert r["prefix"] and all(isinstance(t, str) and t for t in r["prefix"])
        if r["kind"] == "change":
            assert 0 <= r["superseded_turn"] < len(r["prefix"]) and r["new_fact"]
        else:
            assert r["superseded_turn"] is None
