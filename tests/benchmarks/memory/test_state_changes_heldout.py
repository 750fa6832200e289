"""The sealed held-out set of changes of state (benchmarks/data/state_changes): the data matches its committed
sha256, and its rows have the documented shape and counts."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from pathlib import Path

import pytest

DATA = Path(__file__).resolve().parents[3] / "benchmarks" / "data" / "state_changes"
SEALED = ["heldout", *(f"heldout_v{i}" for i in range(2, 23))]


@pytest.mark.parametrize("name", SEALED)
def test_data_matches_its_sealed_hash(name: str) -> None:
    digest, file = (DATA / f"{name}.jsonl.sha256").read_text().split()
    assert file == f"{name}.jsonl"
    assert hashlib.sha256((DATA / f"{name}.jsonl").read_bytes()).hexdigest() == digest


@pytest.mark.parametrize("name", SEALED)
def test_rows_have_the_documented_shape(name: str) -> None:
    rows = [json.loads(line) for line in (DATA / f"{name}.jsonl").read_text().splitlines()]
    kinds = Counter(r["kind"] for r in rows)
    assert kinds == {"change": 106, "non_change": 109}
    assert len({r["id"] for r in rows}) == len(rows)
    for r in rows:
        assert set(r) == {
            "id",
            "kind",
            "category",
            "prefix",
            "turn",
            "superseded_turn",
            "old_fact",
            "new_fact",
        }
        assert r["prefix"] and all(isinstance(t, str) and t for t in r["prefix"])
        if r["kind"] == "change":
            assert 0 <= r["superseded_turn"] < len(r["prefix"]) and r["new_fact"]
        else:
            assert r["superseded_turn"] is None


def test_the_scorer_counts_catches_false_supersessions_and_chit_chat(tmp_path) -> None:
    """benchmarks.memory.state_changes_heldout on hand-made items (not the sealed ones): one change caught,
    one missed, one chit-chat turn that forms a memory and supersedes, and a tampered file refused."""
    from benchmarks.memory.state_changes_heldout import load_items, score
    from kvmem.formation.rules import RuleExtractor

    def row(i: str, kind: str, category: str, prefix: list[str], turn: str, new: str | None) -> dict:
        index = len(prefix) - 1 if kind == "change" else None
        return {"id": i, "kind": kind, "category": category, "prefix": prefix, "turn": turn,
                "superseded_turn": index, "old_fact": "x", "new_fact": new}  # fmt: skip

    rows = [
        row(
            "c0", "change", "move", ["I love jazz.", "I live in Oslo."], "I moved to Bergen.", "home: Bergen"
        ),
        row("c1", "change", "move", ["I live in Oslo."], "Bergen is where I sleep now.", "home: Bergen"),
        row("n0", "non_change", "restatement", ["I live in Oslo."], "I moved to Oslo.", "home: Oslo"),
        row("n1", "non_change", "chit_chat", ["I live in Oslo."], "I moved to Bergen.", None),
        row("n2", "non_change", "chit_chat", ["I live in Oslo."], "Thanks!", None),
    ]
    data = "".join(json.dumps(r) + "\n" for r in rows).encode()
    (tmp_path / "heldout.jsonl").write_bytes(data)
    (tmp_path / "heldout.jsonl.sha256").write_text(hashlib.sha256(data).hexdigest() + "  heldout.jsonl\n")
    got = score(load_items(tmp_path), RuleExtractor())
    assert (got["changes_caught"], got["changes_superseding_another_memory"]) == (0.5, 0)
    assert [m["id"] for m in got["misses"]] == ["c1", "n1"]
    assert (got["false_supersessions"], got["chit_chat_stored"], got["no_new_fact_but_stored"]) == (
        0.3333,
        1,
        1,
    )
    (tmp_path / "heldout.jsonl").write_bytes(data.replace(b"Oslo", b"Olso"))
    with pytest.raises(ValueError, match="sha256 differs"):
        load_items(tmp_path)


def test_the_served_path_scores_the_rules_as_the_direct_path(tmp_path) -> None:
    """`--served` (the path `--extractor self` always takes): each turn logged in a MemoryStore and formed by
    the server's FormationWorker; on hand-made items the rules score as through consolidate_batch directly."""
    from benchmarks.memory.state_changes_heldout import score, served_runner
    from kvmem.formation.rules import RuleExtractor
    from kvmem.text import HashEmbedder

    def row(i: str, kind: str, prefix: list[str], turn: str, new: str | None) -> dict:
        return {"id": i, "kind": kind, "category": "move" if kind == "change" else "chit_chat", "prefix": prefix,
                "turn": turn, "superseded_turn": 0 if kind == "change" else None, "old_fact": "x",
                "new_fact": new}  # fmt: skip

    items = [
        row("c0", "change", ["I live in Oslo."], "I moved to Bergen.", "home: Bergen"),
        row("c1", "change", ["I live in Oslo."], "Bergen is where I sleep now.", "home: Bergen"),
        row("n0", "non_change", ["I live in Oslo."], "Thanks!", None),
    ]
    served = score(items, served_runner("rules", None, tmp_path, embedder=HashEmbedder()))
    direct = score(items, RuleExtractor())
    at_once = score(  # `--concurrency`: items formed on threads, scored in the set's order
        items, served_runner("rules", None, tmp_path / "at_once", embedder=HashEmbedder()), concurrency=3
    )
    assert at_once == served
    assert [m["id"] for m in served["misses"]] == [m["id"] for m in direct["misses"]] == ["c1"]
    for key in ("changes_caught", "false_supersessions", "chit_chat_stored", "no_new_fact_but_stored"):
        assert served[key] == direct[key]
    assert (served["changes_caught"], served["false_supersessions"], served["chit_chat_stored"]) == (
        0.5,
        0.0,
        0,
    )
