"""benchmarks.memory.block_wording: the held-out conversation's memories as the rules form them, and a run on the
default model over two orders of each block, its answers counted per prompt as each answer reads."""

from __future__ import annotations

import json

import pytest

from benchmarks.memory import block_wording


def test_the_held_out_memories_are_one_fact_each_as_the_rules_form_them() -> None:
    assert block_wording.held_out_memories() == [
        "I live in Porto.",
        "My husband is Tiago.",
        "I work as a pharmacist.",
        "My daughter is called Lia.",
        "I have a cat named Biscuit.",
        "I'm allergic to shellfish.",
        "My favourite sport is volleyball.",
    ]


@pytest.mark.slow
def test_a_run_asks_every_question_per_order_and_prompt_and_counts_its_answers(default_model_dir, tmp_path):
    out = tmp_path / "wording.json"
    argv = ["--model", str(default_model_dir), "--orders", "2", "--max-tokens", "3", "--threads", "1"]
    assert block_wording.main([*argv, "--system", "Be brief.", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    (row,) = result["prompts"]
    assert row["system_prompt"] == "Be brief." and result["orders"] == 2
    assert (row["demo"]["questions"], row["held_out"]["questions"]) == (10, 12)
    for name in ("demo", "held_out"):
        mine = [a for a in row["answers"] if a["set"] == name]
        assert row[name]["right"] == sum(a["right"] for a in mine)
        assert row[name]["user_voice"] == sum(a["user_voice"] for a in mine)
    assert [a["order"] for a in row["answers"]] == [0] * 11 + [1] * 11
