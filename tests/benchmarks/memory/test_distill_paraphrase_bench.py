"""benchmarks.memory.distill_paraphrase end to end on the tiny llama (plumbing, not figures): the production job
trains with augmentation, the held-out set is read only when its sha256 matches, and every held-out question is
asked of the adapter and of the control user."""

from __future__ import annotations

import json

import pytest

from benchmarks.memory import distill_paraphrase


def test_the_held_out_set_is_refused_when_edited(tmp_path):
    data = distill_paraphrase.load_heldout()
    assert len(data["questions"]) == 8 and len(data["facts"]) == 3
    edited = tmp_path / "heldout.json"
    edited.write_text(distill_paraphrase.HELDOUT.read_text().replace("Pellwyn", "Pelwyn"))
    (tmp_path / "heldout.json.sha256").write_text(
        (distill_paraphrase.HELDOUT.parent / "heldout.json.sha256").read_text()
    )
    with pytest.raises(ValueError, match="sha256 differs"):
        distill_paraphrase.load_heldout(edited)


def test_the_bench_asks_every_held_out_question_of_the_adapter_and_the_control(
    tmp_path, tiny_model_dir, capsys
):
    pytest.importorskip("peft")
    out = tmp_path / "p.json"
    argv = ["--max-steps", "2", "--eval-every", "1", "--model", str(tiny_model_dir), "--out", str(out)]
    result = distill_paraphrase.main(argv)
    assert (
        json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == json.loads(out.read_text()) == result
    )
    assert result["augment"] is True and result["train"]["steps"] == 2
    # a random tiny model learns nothing in two steps: refused, served for no fact, answers nothing
    assert (result["activated"], result["num_facts_served"]) == (False, 0)
    asked = [r["question"] for r in result["questions"]]
    assert asked == [q["question"] for q in distill_paraphrase.load_heldout()["questions"]]
    assert result["num_questions"] == 8 and result["num_answered_served"] == 0
    assert not any(r["served"] for r in result["questions"])
