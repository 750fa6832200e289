"""formed_recall on the hand-written sample: keys, ranges, and source-turn crediting."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from benchmarks.memory.formed_recall import MODES, credit, evidence_coverage, main

SAMPLE = Path(__file__).resolve().parents[3] / "benchmarks" / "data" / "conversation_sample"


def _hit(memory_id: str, turns: tuple[str, ...] = ()) -> SimpleNamespace:
    return SimpleNamespace(memory=SimpleNamespace(id=memory_id, source_turn_ids=turns))


def test_credit_expands_source_turns_in_rank_order_deduplicated_and_cut():
    raw = {"m1": "D1:1"}
    turns = {"t1": "D1:1", "t2": "D1:2", "t3": "D1:3"}
    hits = [_hit("f1", ("t2", "t1")), _hit("m1"), _hit("f2", ("t3", "t2", "gone"))]
    assert credit(hits, raw, turns) == ["D1:2", "D1:1", "D1:3"]
    assert credit(hits, raw, turns, limit=2) == ["D1:2", "D1:1"]


def test_evidence_coverage_counts_evidence_turns_that_formed_a_current_memory_over_every_page():
    memories = [SimpleNamespace(source_turn_ids=t) for t in (("t1",), ("t3", "gone"), ("t1", "t4"))]

    def listed(user_id, page, page_size):
        assert user_id == "realtalk/Chat_1" and page_size == 2
        items = memories[(page - 1) * 2 : page * 2]
        return SimpleNamespace(items=items, total=len(memories))

    store = SimpleNamespace(list=listed, config=SimpleNamespace(max_page_size=2))
    questions = [SimpleNamespace(evidence=e) for e in (("D1", "D2"), ("D3",), (), ("D2", "D5"), ("D4", "D1"))]
    conversation = SimpleNamespace(name="Chat_1", questions=questions)
    turns = {"realtalk/Chat_1": {"t1": "D1", "t2": "D2", "t3": "D3", "t4": "D4", "t5": "D5"}}
    assert evidence_coverage(store, [conversation], turns) == {
        "evidence_turns": 7,  # the question with no evidence is not scored
        "evidence_turns_with_a_memory": round(4 / 7, 4),  # D1 twice, D3, D4 (t4 on the second page)
        "questions_all_evidence_with_a_memory": 0.5,
        "questions_any_evidence_with_a_memory": 0.75,
    }


def test_main_on_the_sample(tmp_path, capsys):
    out = tmp_path / "formed_recall.json"
    assert (
        main(
            [
                "--data-dir",
                str(SAMPLE),
                "--split",
                "all",
                "--embedder",
                "hash",
                "--limit-chats",
                "2",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result == json.loads(out.read_text())
    for key in (
        "git_sha",
        "dataset",
        "embedder",
        "num_turns",
        "num_formed_memories",
        "formation",
        "recall",
        "loadavg_start",
        "loadavg_end",
    ):
        assert key in result
    assert result["dataset"]["conversations"] == ["Chat_1_Ana_Ben", "Chat_2_Cleo_Dev"]
    assert result["num_turns"] == result["dataset"]["num_turns"] > 0
    assert set(result["recall"]) == set(MODES)
    for mode in MODES:
        r = result["recall"][mode]
        assert r["num_questions"] == result["dataset"]["num_questions_scored"] > 0
        for key in ("recall@5", "recall@10", "mrr"):
            assert 0.0 <= r[key] <= 1.0
        assert r["recall@5"] <= r["recall@10"]
        assert r["by_category"] and all(0.0 <= c["recall@10"] <= 1.0 for c in r["by_category"].values())
        assert 0 <= r["mean_dia_ids_credited"] <= 10
    for mode in ("formed", "both"):
        f = result["formation"][mode]
        assert f["turns_formed"] == result["num_turns"]  # every logged turn formed, nothing left pending
        assert f["failed_passes"] == 0 and f["formation_s"] >= 0
    assert result["num_formed_memories"] == result["formation"]["formed"]["added"] >= 0
    coverage = result["formation"]["formed"]["coverage"]
    assert coverage["evidence_turns"] >= result["dataset"]["num_questions_scored"]
    assert (
        0.0
        <= coverage["questions_all_evidence_with_a_memory"]
        <= coverage["questions_any_evidence_with_a_memory"]
    )
    assert coverage["questions_any_evidence_with_a_memory"] <= 1.0
    # raw mode credits every turn, so it sees the sample's evidence
    assert result["recall"]["raw"]["recall@10"] > 0


def test_log_and_form_uses_the_self_extractors_own_decider(tmp_path, monkeypatch):
    """With a ModelExtractor, formation goes through its own decider (the server's `--extractor self` path):
    its scripted replies (not the model's: this checks the benchmark's wiring) give the memories, and the
    second statement of the same fact is decided "none" by the decision reply, not by consolidation's rules."""
    from benchmarks.memory.conversations import load_split
    from benchmarks.memory.formed_recall import log_and_form
    from kvmem.formation.self_model import ModelExtractor
    from kvmem.text import HashEmbedder, MemoryStore

    asked: list[str] = []

    def generate(messages, schema, max_tokens):
        asked.append("decide" if "event" in schema["properties"] else "extract")
        if asked[-1] == "decide":
            return json.dumps({"event": "none", "memory": 0}), "stop"
        fact = {"text": "Ana has a dog named Rex.", "kind": "fact", "slot_subject": "user",
                "slot_attribute": "dog", "slot_value": "Rex", "valid_from": None}  # fmt: skip
        return json.dumps({"facts": [fact]}), "stop"

    monkeypatch.setattr(
        "benchmarks.memory.formed_recall.BATCH_TURNS", 2
    )  # several passes, so later ones decide
    conversations = load_split(SAMPLE, "all")[:1]
    with MemoryStore(tmp_path / "m.db", embedder=HashEmbedder()) as store:
        _, figures = log_and_form(store, conversations, ModelExtractor(generate))
        texts = [m.text for m in store.list("realtalk/Chat_1_Ana_Ben", page_size=100).items]
    assert texts == ["Ana has a dog named Rex."]
    assert asked[:2] == ["extract", "extract"] and asked.count("decide") == asked.count("extract") - 1 > 0
    assert (figures["added"], figures["duplicates"]) == (1, asked.count("decide"))
