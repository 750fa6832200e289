"""The store benchmark's code on a tiny size: the JSON it prints and writes has the documented shape, and
its recall figures on the fixed-seed set are exact; on the full set, hybrid beats both legs (the README's
claim)."""

from __future__ import annotations

import json

import pytest

from benchmarks.memory.memory_dataset import generate
from benchmarks.tiers import store_bench


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
        "env",
        "add_ms",
        "search_ms",
        "import",
        "recall",
        "hybrid_beats_both",
    }
    assert result["embedder"] == "hash-bow-64" and result["sizes"]["bulk_total"] == 300
    assert set(result["add_ms"]) == {"p50", "p90", "p99", "n"} and result["add_ms"]["n"] == 5
    for mode in ("keyword", "dense", "hybrid"):
        assert (
            set(result["search_ms"][mode]) == {"p50", "p90", "p99", "n"}
            and result["search_ms"][mode]["n"] == 3
        )
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
    assert result["env"]["git_sha"] == store_bench.env_info()["git_sha"] and "loadavg" in result["env"]
    share = result["env"]["others_cpu_share"]  # None: a run shorter than one clock tick of /proc/stat
    assert share is None or 0.0 <= share <= 1.0
    # hash embedder, seed 0: the same figures on every run; hybrid is above keyword and dense at @5 and @10
    assert result["recall"] == {
        "num_memories": 160,
        "num_questions": 56,
        "num_time_filtered": 12,
        "keyword": {
            "recall@5": 0.5357,
            "recall@10": 0.5357,
            "time_filtered_recall@5": 0.5,
            "time_filtered_recall@10": 0.5,
        },
        "dense": {
            "recall@5": 0.4643,
            "recall@10": 0.5714,
            "time_filtered_recall@5": 0.6667,
            "time_filtered_recall@10": 0.8333,
        },
        # issue 13's first stage, reordered by the shipped second stage: issue 45's refit (on MiniLM's query-head
        # vectors, REALTALK tune) scores this synthetic hash-embedder set below issue 28's weights (R@10 0.8036)
        "hybrid": {
            "recall@5": 0.6786,
            "recall@10": 0.7679,
            "time_filtered_recall@5": 0.75,
            "time_filtered_recall@10": 0.9167,
        },
    }
    assert result["hybrid_beats_both"] is True


def test_hybrid_beats_both_needs_every_leg_and_k():
    recall = {
        "keyword": {"recall@5": 0.5, "recall@10": 0.6},
        "dense": {"recall@5": 0.7, "recall@10": 0.8},
        "hybrid": {"recall@5": 0.71, "recall@10": 0.81},
    }
    assert store_bench.hybrid_beats_both(recall) is True
    recall["hybrid"]["recall@10"] = 0.8  # a tie with dense at @10 is not beating it
    assert store_bench.hybrid_beats_both(recall) is False


@pytest.mark.slow
def test_hybrid_beats_keyword_on_the_full_recall_set(tmp_path):
    """The README's synthetic recall table: seed 0, the full set (14,400 memories, 560 questions), default
    embedder. Since the hybrid was tuned on real dialogue (issue 13) it no longer beats dense here (0.886 vs 0.895
    at @10, benchmarks/results/cpu/store_bench_recall.json), and the README says so; what holds is that it is far
    above keyword search."""
    out = tmp_path / "recall.json"
    assert store_bench.main(["--recall-only", "--no-progress", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert (result["seed"], result["recall"]["num_memories"], result["recall"]["num_questions"]) == (
        0,
        14_400,
        560,
    )
    assert result["add_ms"] is None and result["import"] is None
    recall = result["recall"]
    for k in ("recall@5", "recall@10"):
        assert recall["hybrid"][k] > recall["keyword"][k] + 0.25, (k, recall)


def test_dataset_is_deterministic_and_planted():
    a, b = generate(2, 4, 20, seed=3), generate(2, 4, 20, seed=3)
    assert a == b
    keys = [t.key for t in a.turns if t.key]
    assert len(keys) == len(set(keys)) == 2 * (11 + 6)
    assert {k for q in a.questions for k in q.evidence_keys} == set(keys)
    timed = [q for q in a.questions if q.time_range]
    assert len(timed) == 2 * 6
