"""The store benchmark's code on a tiny size: the JSON it prints and writes has the documented shape."""

from __future__ import annotations

import json

from benchmarks import store_bench
from benchmarks.memory_dataset import generate


def test_tiny_run_json_shape(tmp_path, capsys, monkeypatch):
    tiny = store_bench.Sizes(
        num_users=2,
        num_sessions=4,
        turns_per_session=20,
        num_adds=5,
        bulk_total=300,
        bulk_big_user=100,
        num_searches=3,
    )
    monkeypatch.setattr(store_bench, "QUICK", tiny)
    out = tmp_path / "bench.json"
    assert store_bench.main(["--quick", "--embedder", "hash", "--no-progress", "--out", str(out)]) == 0
    last_line = capsys.readouterr().out.strip().splitlines()[-1]
    result = json.loads(last_line)
    assert result == json.loads(out.read_text())
    assert set(result) == {
        "benchmark",
        "seed",
        "sizes",
        "embedder",
        "fusion",
        "machine",
        "add_ms",
        "search_ms",
        "import",
        "recall",
        "hybrid_beats_both",
    }
    assert result["embedder"] == "hash-bow-64" and result["sizes"]["bulk_total"] == 300
    assert set(result["add_ms"]) == {"p50", "p90", "n"} and result["add_ms"]["n"] == 5
    for mode in ("keyword", "dense", "hybrid"):
        assert set(result["search_ms"][mode]) == {"p50", "p90", "n"} and result["search_ms"][mode]["n"] == 3
        assert set(result["recall"][mode]) == {
            "recall@5",
            "recall@10",
            "time_filtered_recall@5",
            "time_filtered_recall@10",
        }
    assert (result["search_ms"]["big_user_memories"], result["search_ms"]["file_memories"]) == (100, 300)
    assert result["import"]["num_memories"] == 300
    assert result["recall"]["num_memories"] == 2 * 4 * 20
    assert result["recall"]["num_questions"] == 2 * (11 * 2 + 3 * 2)
    assert isinstance(result["hybrid_beats_both"], bool)


def test_dataset_is_deterministic_and_planted():
    a, b = generate(2, 4, 20, seed=3), generate(2, 4, 20, seed=3)
    assert a == b
    keys = [t.key for t in a.turns if t.key]
    assert len(keys) == len(set(keys)) == 2 * (11 + 6)
    assert {k for q in a.questions for k in q.evidence_keys} == set(keys)
    timed = [q for q in a.questions if q.time_range]
    assert len(timed) == 2 * 6
