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
    assert all(a["repeated"] == [] for a in row["answers"])


@pytest.mark.slow
def test_echo_repeats_the_store_searchs_top_hits_of_the_same_memories(default_model_dir, tmp_path):
    out = tmp_path / "echo.json"
    argv = ["--model", str(default_model_dir), "--orders", "1", "--max-tokens", "2", "--threads", "1"]
    assert block_wording.main([*argv, "--system", "Be brief.", "--echo", "0", "2", "--out", str(out)]) == 0
    plain, echoed = json.loads(out.read_text())["prompts"]
    assert (plain["echo"], echoed["echo"]) == (0, 2)
    held_out = block_wording.held_out_memories()
    for a in echoed["answers"]:
        assert len(a["repeated"]) == 2 and len(set(a["repeated"])) == 2
        assert set(a["repeated"]) <= set(held_out if a["set"] == "held_out" else block_wording.DEMO_MEMORIES)
    # the search's first hit for each demo question names what it asks about
    first = {a["question"]: a["repeated"][0] for a in echoed["answers"] if a["set"] == "demo"}
    assert first["What is my dog called?"] == "I have a golden retriever called Miso."
    assert first["What am I allergic to?"] == "I am allergic to peanuts."
