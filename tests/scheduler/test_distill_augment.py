"""Knowledge augmentation before distillation (scheduler.distill.augment): the exact examples made for given facts,
every reply recalls its fact, and no augmented prompt is a validation or gate question, nor one of the
benchmark's held-out paraphrases (the first written by hand before these templates, the second by a helper that saw
neither them nor the first set)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from scheduler.distill.augment import AUGMENTS, CONTEXTS, FRAMINGS, augmented_examples
from scheduler.distill.data import (
    RELATIONS,
    Example,
    gate_questions,
    parse_fact,
    recalled,
    training_examples,
    valid_questions,
)

HELDOUT_DIR = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "distill_paraphrases"

# one fact of every shape data.parse_fact reads
TEXTS = [
    "My dog is called Miso.",
    "I live in Porto.",
    "I work at Blue Harbor Bakery.",
    "I was born in Braga.",
    "I am allergic to peanuts.",
    "My favourite colour is green.",
]


def _facts(texts=TEXTS):
    facts = [parse_fact(f"m{i}", 1, t) for i, t in enumerate(texts)]
    assert all(f is not None for f in facts)
    return facts


def _norm(text: str) -> str:
    return " ".join(re.findall(r"[0-9a-z']+", text.lower()))


def test_a_name_fact_is_restated_and_asked_in_these_exact_examples():
    ex = augmented_examples(_facts(["My dog is called Miso."]))
    assert len(ex) == 4 + 2 * 10 + 6
    assert ex[:8] == [
        Example(
            "m0", "statement", "What do you know about me?", 'You told me: "My dog is called Miso."', "Miso"
        ),
        Example(
            "m0",
            "statement",
            "Tell me something I told you about myself.",
            'You told me: "I have a dog named Miso."',
            "Miso",
        ),
        Example(
            "m0",
            "statement",
            "Summarise what I've shared with you.",
            'You told me: "Miso is what I call my dog."',
            "Miso",
        ),
        Example(
            "m0",
            "statement",
            "What have I said about my life?",
            'You told me: "The name of my dog is Miso."',
            "Miso",
        ),
        Example("m0", "question", "What name does my dog go by?", "Your dog is called Miso.", "Miso"),
        Example("m0", "question", "Quick question: what name does my dog go by?", "Miso.", "Miso"),
        Example(
            "m0",
            "question",
            "Quick question: my dog, what was the name again?",
            "Your dog's name is Miso.",
            "Miso",
        ),
        Example("m0", "question", "Hey, my dog, what was the name again?", "Miso.", "Miso"),
    ]
    # a framing that ends a sentence keeps the capital; "I" keeps its capital after any framing
    assert ex[9].question == "Sorry, I forget things. Which name did I give my dog?"
    assert ex[17].question == "Quick question: I'm writing a card for my dog. Which name goes on it?"
    # then each situation once: bare, then after a sentence of context, replies as the questions'
    assert ex[24:27] == [
        Example(
            "m0",
            "question",
            "If I were calling my dog over, which name would I use?",
            "Your dog is called Miso.",
            "Miso",
        ),
        Example(
            "m0",
            "question",
            "I'm sorting out a few things today. I'm telling a story about my dog. What name do I use?",
            "Miso.",
            "Miso",
        ),
        Example(
            "m0",
            "question",
            "My dog just did something funny. What's the name again?",
            "You named your dog Miso.",
            "Miso",
        ),
    ]
    assert ex[-1].question == "This might sound odd, but what did we say my dog goes by"


def test_a_place_fact_without_a_subject_is_asked_in_these_exact_examples():
    ex = augmented_examples(_facts(["I live in Porto."]))
    assert [(e.kind, e.question, e.reply) for e in ex[:7]] == [
        ("statement", "What do you know about me?", 'You told me: "I live in Porto."'),
        ("statement", "Tell me something I told you about myself.", 'You told me: "I\'m based in Porto."'),
        ("statement", "Summarise what I've shared with you.", 'You told me: "Home for me is Porto."'),
        ("statement", "What have I said about my life?", 'You told me: "I reside in Porto."'),
        ("question", "Which city is my home in?", "You live in Porto."),
        ("question", "Quick question: which city is my home in?", "Porto."),
        ("question", "Quick question: where am I based?", "You're based in Porto."),
    ]
    assert ex[-7] == Example("m0", "question", "One more thing: where do I stay?", "Porto.", "Porto")
    assert ex[-6] == Example(
        "m0",
        "question",
        "If a friend wanted to visit me at home, which town would they go to?",
        "You live in Porto.",
        "Porto",
    )


def test_every_shape_has_templates_and_every_reply_recalls_its_fact():
    assert set(AUGMENTS) == set(RELATIONS)
    facts = _facts()
    assert sorted({f.relation for f in facts}) == sorted(RELATIONS)
    ex = augmented_examples(facts)
    per_fact = {f.memory_id: 0 for f in facts}
    for e in ex:
        per_fact[e.memory_id] += 1
        assert recalled(e.reply, e.answer), e
    # per fact: every restatement, every question under two framings, every situation once
    counts = {
        f.memory_id: 2 * len(AUGMENTS[f.relation].asks) + len(AUGMENTS[f.relation].situations) for f in facts
    }
    assert all(len(a.situations) == 6 for a in AUGMENTS.values())
    assert per_fact == {f.memory_id: len(AUGMENTS[f.relation].says) + counts[f.memory_id] for f in facts}
    assert len({(e.memory_id, e.question) for e in ex if e.kind == "question"}) == sum(
        counts.values()
    )  # no question asked twice
    assert augmented_examples(facts) == ex  # deterministic
    assert FRAMINGS[0] == ""  # each question is also asked bare
    assert all(c.endswith(" ") for c in CONTEXTS)


def test_no_augmented_prompt_is_a_validation_or_gate_question():
    facts = _facts()
    held = {_norm(q.question) for q in valid_questions(facts) + gate_questions(facts, seed=7)}
    assert not held & {_norm(e.question) for e in augmented_examples(facts)}


@pytest.mark.parametrize(
    ("name", "count"),
    [
        ("heldout.json", 8),
        ("heldout_v2.json", 18),
        ("heldout_v3.json", 18),
        ("heldout_v4.json", 18),
        ("heldout_v5.json", 18),
        ("heldout_v6.json", 18),
        ("heldout_v7.json", 18),
        ("heldout_v8.json", 18),
    ],
)
def test_the_benchmarks_held_out_paraphrases_are_no_prompt_of_training_or_the_gates(name, count):
    data = json.loads((HELDOUT_DIR / name).read_text())
    facts = _facts(data["facts"])
    prompts = training_examples(facts, seed=0) + augmented_examples(facts)
    prompts += valid_questions(facts) + gate_questions(facts, seed=0)
    seen = {_norm(e.question) for e in prompts}
    questions = [_norm(q["question"]) for q in data["questions"]]
    assert len(questions) == count and not seen & set(questions)
    for q in data["questions"]:  # each names its own fact's answer
        assert q["answer"] == facts[q["fact"]].answer


def test_every_sealed_paraphrase_set_matches_the_hash_committed_with_it():
    from benchmarks.memory.distill_paraphrase import load_heldout  # the benchmark's own check of the seal

    sealed = sorted(HELDOUT_DIR.glob("heldout*.json"))
    assert [p.name for p in sealed] == [
        f"heldout{v}.json" for v in ("", "_v2", "_v3", "_v4", "_v5", "_v6", "_v7", "_v8")
    ]
    for path in sealed:
        assert load_heldout(path)["facts"], path.name  # raises ValueError when the sha256 differs
