"""The distillation selection policy and the fact parser: pure functions, exact choices and reasons."""

from __future__ import annotations

import pytest

from scheduler.distill.data import (
    GENERIC_TRAIN,
    RELATIONS,
    UNANSWERABLE_GATE,
    UNANSWERABLE_TRAIN,
    UNANSWERABLE_VALID,
    gate_questions,
    parse_fact,
    recalled,
    training_examples,
    unanswerable_gate,
    valid_questions,
)
from scheduler.distill.gates import GENERIC_GATE
from scheduler.distill.selection import MemoryInfo, SelectConfig, select_facts
from scheduler.heat import HeatStats

DAY = 24 * 3600.0
NOW = 100 * DAY


def _stats(uses: int, last_change: float, score: float = 1.0) -> HeatStats:
    return HeatStats(
        score=score,
        score_at=NOW,
        hits=uses,
        uses=uses,
        first_seen=0.0,
        last_access=NOW,
        last_change=last_change,
    )


def _shape(fact):
    return (fact.relation, fact.subject, fact.answer)


def test_parse_fact_reads_the_shapes_it_knows_and_nothing_else():
    assert _shape(parse_fact("m", 2, "My dog is called Miso.")) == ("name", "dog", "Miso")
    assert _shape(parse_fact("m", 1, "my sister's name is Ana Lucia")) == ("name", "sister", "Ana Lucia")
    assert _shape(parse_fact("m", 1, "I live in Porto.")) == ("live", "", "Porto")
    assert _shape(parse_fact("m", 1, "I work at Blue Harbor Bakery.")) == ("work", "", "Blue Harbor Bakery")
    assert _shape(parse_fact("m", 1, "My favourite colour is green.")) == (
        "attribute",
        "favourite colour",
        "green",
    )
    assert parse_fact("m", 1, "I like rainy days a lot.") is None
    assert parse_fact("m", 1, "Yesterday we talked about my dog.") is None


def test_gate_questions_never_use_a_training_template():
    facts = [parse_fact(f"m{i}", 1, t) for i, t in enumerate(["My dog is called Miso.", "I live in Porto."])]
    train = {e.question for e in training_examples(facts, seed=0)}
    for seed in range(20):
        gate = gate_questions(facts, seed=seed)
        assert sorted(g.answer for g in gate) == ["Miso", "Miso", "Porto", "Porto"]
        assert not {g.question for g in gate} & train
    valid = valid_questions(facts)
    assert [(v.question, v.answer) for v in valid] == [
        ("Remind me, what is my dog's name?", "Miso"),
        ("Do you know what my dog is called?", "Miso"),
        ("Remind me, where do I live?", "Porto"),
        ("Do you know where my home is?", "Porto"),
        *[(q, None) for q in UNANSWERABLE_VALID],
    ]
    for rel in RELATIONS.values():
        train_templates = set(rel.train_questions + rel.reverse)
        assert not set(rel.gate_questions) & train_templates
        assert not set(rel.valid_questions) & (train_templates | set(rel.gate_questions))
    pools = [set(UNANSWERABLE_TRAIN), set(UNANSWERABLE_VALID), set(UNANSWERABLE_GATE)]
    assert sum(map(len, pools)) == len(set.union(*pools))
    # the damage gate's generic prompts are never replayed in training
    assert len(set(GENERIC_TRAIN)) == len(GENERIC_TRAIN) == 40
    assert not set(GENERIC_TRAIN) & set(GENERIC_GATE)
    examples = training_examples(facts, seed=0)
    assert sorted({e.kind for e in examples}) == ["question", "reverse", "statement", "unanswerable"]
    assert sorted(e.question for e in examples if e.kind == "unanswerable") == sorted(UNANSWERABLE_TRAIN)
    # replies take turns among the relation's phrasings
    assert {e.reply for e in examples if e.memory_id == "m0" and e.kind == "question"} == {
        "Your dog is called Miso.",
        "Your dog's name is Miso.",
        "Miso is the name of your dog.",
    }


def test_recalled_matches_whole_words_ignoring_case_and_punctuation():
    assert recalled("Your dog is called  miso!", "Miso") and not recalled("Your dog is Max.", "Miso")
    assert recalled("You work at Blue-Harbor bakery.", "Blue Harbor Bakery")
    assert not recalled("Misogyny is a word.", "Miso") and not recalled("Blue Harbor", "Blue Harbor Bakery")
    assert not recalled("anything", "...")


def test_only_stable_used_uncontradicted_facts_are_chosen_hottest_first_up_to_the_cap():
    memories = [
        MemoryInfo("a", 1, "My dog is called Miso.", 1 * DAY),
        MemoryInfo("b", 1, "I live in Porto.", 2 * DAY),
        MemoryInfo("c", 2, "I work at Acme.", NOW - DAY),  # changed yesterday
        MemoryInfo("d", 1, "My favourite colour is green.", 3 * DAY),  # rarely used
        MemoryInfo("e", 1, "I like rainy days.", 1 * DAY),  # not a fact we can phrase
        MemoryInfo("f", 1, "My cat is called Tom.", 1 * DAY),
        MemoryInfo("g", 1, "My cat is called Felix.", 1 * DAY),  # contradicts f
        MemoryInfo("h", 1, "I was born in Lyon.", 1 * DAY),
    ]
    stats = {
        "a": _stats(9, 1 * DAY, score=2.0),
        "b": _stats(7, 2 * DAY, score=5.0),
        "c": _stats(20, NOW - DAY),
        "d": _stats(1, 3 * DAY),
        "e": _stats(50, 1 * DAY),
        "f": _stats(9, 1 * DAY),
        "g": _stats(9, 1 * DAY),
        "h": _stats(9, 1 * DAY, score=0.5),
    }
    config = SelectConfig(min_stable_s=7 * DAY, min_uses=5, max_facts=2)
    sel = select_facts(memories, stats, NOW, config)
    assert [f.memory_id for f in sel.facts] == ["b", "a"]  # hottest first
    assert dict(sel.skipped) == {
        "e": "not a fact the distiller can phrase",
        "c": "changed recently",
        "d": "not used often enough",
        "f": "contradicted by another memory",
        "g": "contradicted by another memory",
        "h": "over the cap of 2 facts",
    }
    # the heat table's own last change counts too (a change the store's clock did not see yet)
    late = dict(stats, a=_stats(9, NOW - 60))
    assert [f.memory_id for f in select_facts(memories, late, NOW, config).facts] == ["b", "h"]
    # --all: stability and use no longer required; contradictions and the cap still apply
    every = select_facts(memories, stats, NOW, SelectConfig(max_facts=10), every=True)
    assert [f.memory_id for f in every.facts] == ["b", "a", "c", "d", "h"]  # heat 5, 2, 1, 1 (id order), 0.5
    assert dict(every.skipped)["f"] == "contradicted by another memory"


def test_a_fact_whose_twin_changed_recently_waits():
    memories = [
        MemoryInfo("a", 1, "I live in Porto.", 1 * DAY),
        MemoryInfo("b", 1, "I live in porto", NOW - 10),
    ]
    sel = select_facts(memories, {}, NOW, SelectConfig(min_stable_s=DAY, min_uses=0))
    assert sel.facts == ()
    assert dict(sel.skipped) == {
        "a": "a memory about the same thing changed recently",
        "b": "changed recently",
    }


def test_select_config_names_the_bad_field():
    with pytest.raises(ValueError, match="SelectConfig.max_facts must be >= 1, got 0"):
        SelectConfig(max_facts=0)


def test_a_question_a_fact_answers_is_never_used_as_unanswerable():
    texts = [
        "My favourite board game is Go.",
        "I work at Acme.",
        "My favourite opera is Tosca.",
        "I like tea.",
    ]
    facts = [f for i, t in enumerate(texts) if (f := parse_fact(f"m{i}", 1, t)) is not None]
    assert [f.relation for f in facts] == ["attribute", "work", "attribute"]
    valid = [v.question for v in valid_questions(facts) if v.answer is None]
    assert valid == [q for q in UNANSWERABLE_VALID if q != "What is my favourite board game?"]
    train = [e.question for e in training_examples(facts, seed=0) if e.kind == "unanswerable"]
    assert sorted(train) == sorted(q for q in UNANSWERABLE_TRAIN if q != "What is my favourite opera?")
    gate = [q.question for q in unanswerable_gate(facts)]
    assert gate == [q for q in UNANSWERABLE_GATE if q != "What is my cousin's job?"]  # "job": I work at ...
    assert [q.question for q in unanswerable_gate([])] == list(UNANSWERABLE_GATE)
