"""recall_bench on the hand-written sample: exact structure, and recall / MRR computed right by hand."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.memory.conversations import clean_evidence, load_conversation, load_split, parse_time
from benchmarks.memory.recall_bench import MODES, QuestionScore, run, score_ranking, summarize

SAMPLE = Path(__file__).resolve().parents[3] / "benchmarks" / "data" / "conversation_sample"


def test_score_ranking_by_hand():
    ranked = ["a", "x", "b", "y", "z", "w", "v", "u", "t", "c", "late"]
    score = score_ranking(ranked, ["a", "b", "c"])
    assert score.recall == {5: 2 / 3, 10: 1.0}
    assert score.reciprocal_rank == 1.0
    assert score_ranking(ranked, ["b"]) == QuestionScore({5: 1.0, 10: 1.0}, 1 / 3)
    assert score_ranking(ranked, ["late"]) == QuestionScore({5: 0.0, 10: 0.0}, 0.0)  # rank 11: outside @10
    assert score_ranking([], ["a"]) == QuestionScore({5: 0.0, 10: 0.0}, 0.0)


def test_summarize_means():
    scores = [QuestionScore({5: 1.0, 10: 1.0}, 1.0), QuestionScore({5: 0.0, 10: 0.5}, 0.25)]
    assert summarize(scores) == {"num_questions": 2, "recall@5": 0.5, "recall@10": 0.75, "mrr": 0.625}
    assert summarize([]) == {"num_questions": 0}


def test_evidence_ids_are_cleaned():
    assert clean_evidence(["D1:2.", "D 2:18", "D16:82. D19:2", "", "23:29", "D1:2"]) == [
        "D1:2",
        "D2:18",
        "D16:82",
        "D19:2",
    ]


def test_times_parse_to_iso():
    assert parse_time("29.12.2023, 22:42:04") == "2023-12-29T22:42:04.000000Z"
    assert parse_time("1:56 pm on 8 May, 2023") == "2023-05-08T13:56:00.000000Z"
    with pytest.raises(ValueError):
        parse_time("yesterday")


def test_sample_loads_with_photo_turns_and_bad_ids_handled():
    conversation = load_conversation(SAMPLE / "Chat_1_Ana_Ben.json")
    assert [len(s.turns) for s in conversation.sessions] == [4, 3]  # the empty (photo-only) turn is skipped
    assert [q.evidence for q in conversation.questions] == [("D1:2",), ("D1:4", "D1:2"), ("D2:2",), ()]
    assert [q.num_dropped_evidence for q in conversation.questions] == [0, 0, 0, 1]
    assert conversation.sessions[1].turns[0].chat_time == "2024-03-05T09:15:00.000000Z"
    assert [c.name for c in load_split(SAMPLE, "tune")] == ["Chat_1_Ana_Ben"]
    assert [c.name for c in load_split(SAMPLE, "report")] == ["Chat_2_Cleo_Dev"]


def test_bench_runs_on_the_sample(tmp_path):
    result = run(SAMPLE, "all", "hash", {}, tmp_path / "vectors.npz")
    assert set(result) == {
        "benchmark",
        "git_sha",
        "loadavg",
        "dataset",
        "embedder",
        "config",
        "load_s",
        "recall",
        "hybrid_margin_at_10",
        "margin_at_10",
        "speaker_probe",
    }
    assert set(result["margin_at_10"]) == {"over_keyword", "over_dense", "over_first_stage"}
    # Q1-Q3 name one of their chat's two speakers; Q4 names both
    assert (
        result["speaker_probe"]["named"]["num_questions"]
        == result["speaker_probe"]["wrong_name"]["num_questions"]
    )
    assert {k: v for k, v in result["dataset"].items() if k not in ("source", "commit")} == {
        "name": "REALTALK",
        "split": "all",
        "speaker_in": "role",
        "conversations": ["Chat_1_Ana_Ben", "Chat_2_Cleo_Dev"],
        "num_turns": 10,
        "num_sessions": 3,
        "num_questions": 5,
        "num_questions_scored": 4,
        "num_evidence_ids_dropped": 1,
    }
    assert set(result["recall"]) == set(MODES)
    for mode in MODES:
        r = result["recall"][mode]
        assert set(r) == {"num_questions", "recall@5", "recall@10", "mrr", "by_category", "search_ms_p50"}
        assert r["num_questions"] == 4
        assert {c: s["num_questions"] for c, s in r["by_category"].items()} == {"1": 2, "2": 2}
    # keyword, worked by hand: Q1 finds its turn ("new gym"); Q2 finds 1 of 2 ("gym", not "monthly pass");
    # Q3 ("name", "ana", "puppy") and Q4 ("cleo", "work") share no word with their evidence.
    assert result["recall"]["keyword"]["recall@10"] == 0.375
    # every user has at most 7 turns, so dense (and hybrid) return all of them within the top 10
    assert result["recall"]["dense"]["recall@10"] == 1.0
    assert result["recall"]["hybrid"]["recall@10"] == 1.0
    assert result["recall"]["first_stage"]["recall@10"] == 1.0
    assert (tmp_path / "vectors.npz").is_file()  # the vector cache was written (npz, no pickle)


def test_speaker_in_metadata_ranks_as_speaker_in_role(tmp_path):
    """A multi-party log imported as role 'user' with the speaker in metadata is searched exactly as one whose
    roles are the speakers' names (the speaker is read from metadata first)."""
    by_role = run(SAMPLE, "all", "hash", {}, tmp_path / "vectors.npz")
    by_metadata = run(SAMPLE, "all", "hash", {}, tmp_path / "vectors.npz", speaker_in="metadata")
    assert by_metadata["dataset"]["speaker_in"] == "metadata"
    for mode in MODES:
        strip = lambda r: {k: v for k, v in r.items() if k != "search_ms_p50"}  # noqa: E731
        assert strip(by_metadata["recall"][mode]) == strip(by_role["recall"][mode])
    assert by_metadata["speaker_probe"] == by_role["speaker_probe"]
