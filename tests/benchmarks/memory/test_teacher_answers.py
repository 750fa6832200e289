"""benchmarks/memory/teacher_answers.py: the position it probes is where the answer starts, and the probe's rows
on the tiny llama count each training question once."""

from __future__ import annotations

import pytest

from benchmarks.memory.teacher_answers import _first_answer_token, probe
from scheduler.distill.answers import reply_ids


def test_the_probed_position_is_the_first_token_of_the_answer(tokenizer):
    reply = reply_ids(tokenizer, "Feverfew gives you an allergic reaction.")
    assert _first_answer_token(tokenizer, reply, "feverfew") == 0
    reply = reply_ids(tokenizer, "You work at Vostrel Kinetics.")
    k = _first_answer_token(tokenizer, reply, "Vostrel Kinetics")
    assert tokenizer.decode(reply[:k]) == "You work at"
    with pytest.raises(ValueError, match="'Porto' is not in the reply"):
        _first_answer_token(tokenizer, reply, "Porto")


def test_a_row_per_fact_over_its_relations_training_questions(tiny_handle):
    from scheduler.distill.data import RELATIONS

    rows = probe(tiny_handle, ["I live in Porto.", "My dog is called Miso."], "all")
    assert [(r["fact"], r["relation"], r["questions"]) for r in rows] == [
        ("I live in Porto.", "live", len(RELATIONS["live"].train_questions)),
        ("My dog is called Miso.", "name", len(RELATIONS["name"].train_questions)),
    ]
    assert all(0.0 <= r["mean_p_answer"] <= 1.0 and 0 <= r["top_token_other"] <= r["questions"] for r in rows)
