"""Distillation data: a memory parsed into a fact (key + answer), and the prompts made from it, in several
phrasings and both directions, as questions, plus questions the facts do not answer, and the generic prompts
the replay term keeps the model in place on.

Training and gate prompts come from DISJOINT template sets and different seeds, so a gate measures recall on
questions the adapter never saw. Only memories of a known first-person shape ("My dog is called Miso.",
"I live in Porto.") are facts here: for anything else no question with a checkable answer can be built, so
such memories are not distilled (they stay KV/text). Pure: no model, no store.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Fact:
    """A memory as a fact. `key` is the user's first-person phrase ("my dog's name"), `you_key` the assistant's
    ("your dog's name"), `answer` the span an answer must contain to count as recalled."""

    memory_id: str
    version: int
    text: str
    relation: str  # a RELATIONS name
    subject: str  # the slot the relation's templates fill ("dog", "favourite colour"; "" when fixed)
    answer: str


@dataclass(frozen=True)
class Example:
    """One prompt: a user message and the reply a teacher is asked to score (answer None: no gold span)."""

    memory_id: str | None  # None: an unanswerable or generic prompt
    kind: str  # "statement" | "question" | "reverse" | "unanswerable"
    question: str
    reply: str
    answer: str | None


@dataclass(frozen=True)
class _Relation:
    pattern: str  # over the memory text, lower-cased, no trailing period; groups `s` (subject) and `a`
    statements: tuple[str, ...]  # first person, "{s}" subject, "{a}" answer
    train_questions: tuple[str, ...]
    valid_questions: tuple[str, ...]  # early stopping only: never trained on, never gated
    gate_questions: tuple[str, ...]  # never used in training or early stopping
    replies: tuple[str, ...]  # the assistant's answers, second person; replies[0] is the canonical one
    reverse: tuple[str, ...]  # (question about the answer) -> reply states the fact


# Order matters: the first pattern that matches wins.
RELATIONS: dict[str, _Relation] = {
    "name": _Relation(
        r"^my (?P<s>[a-z' ]+?)(?:'s name is| is called| is named) (?P<a>.+)$",
        (
            "My {s} is called {a}.",
            "My {s}'s name is {a}.",
            "{a} is the name of my {s}.",
            "I named my {s} {a}.",
        ),
        (
            "What is my {s} called?",
            "What is the name of my {s}?",
            "Do you remember my {s}'s name?",
            "What did I name my {s}?",
            "Tell me my {s}'s name.",
            "What do I call my {s}?",
            "Could you remind me of my {s}'s name?",
            "I forgot my {s}'s name. What is it?",
            "Say the name of my {s}.",
            "What's the name I gave my {s}?",
        ),
        ("Remind me, what is my {s}'s name?", "Do you know what my {s} is called?"),
        ("Can you tell me what my {s} is called?", "What's my {s}'s name again?"),
        ("Your {s} is called {a}.", "Your {s}'s name is {a}.", "{a} is the name of your {s}."),
        ("Who is {a}?", "What do you know about {a}?"),
    ),
    "live": _Relation(
        r"^i live in (?P<a>.+)$",
        ("I live in {a}.", "My home is in {a}.", "{a} is where I live."),
        (
            "Where do I live?",
            "In which place is my home?",
            "Do you remember where I live?",
            "Which city do I live in?",
            "Tell me where my home is.",
            "Where is my house?",
            "Could you remind me where I live?",
            "I forgot where I live. Where is it?",
            "Say where my home is.",
            "What's the place I live in?",
        ),
        ("Remind me, where do I live?", "Do you know where my home is?"),
        ("Can you tell me where I live?", "Where is my home?"),
        ("You live in {a}.", "Your home is in {a}.", "{a} is where you live."),
        ("Who lives in {a}?", "What do you know about {a}?"),
    ),
    "work": _Relation(
        r"^i work (?:at|for) (?P<a>.+)$",
        ("I work at {a}.", "My employer is {a}.", "{a} is where I work."),
        (
            "Where do I work?",
            "Who is my employer?",
            "Do you remember where I work?",
            "Where is my job?",
            "Tell me where I work.",
            "Who do I work for?",
            "Could you remind me where I work?",
            "I forgot where I work. Where is it?",
            "Say where I work.",
            "What's the company I work for?",
        ),
        ("Remind me, where do I work?", "Do you know who employs me?"),
        ("Can you tell me where I work?", "Which company do I work for?"),
        ("You work at {a}.", "Your employer is {a}.", "{a} is where you work."),
        ("Who works at {a}?", "What do you know about {a}?"),
    ),
    "born": _Relation(
        r"^i was born in (?P<a>.+)$",
        ("I was born in {a}.", "My birthplace is {a}.", "{a} is where I was born."),
        (
            "Where was I born?",
            "What is my birthplace?",
            "Do you remember where I was born?",
            "In which city was I born?",
            "Tell me where I was born.",
            "Where do I come from?",
            "Could you remind me where I was born?",
            "I forgot where I was born. Where was it?",
            "Say where I was born.",
            "What's my place of birth?",
        ),
        ("Remind me, where was I born?", "Do you know my birthplace?"),
        ("Can you tell me where I was born?", "Which place am I from originally?"),
        ("You were born in {a}.", "Your birthplace is {a}.", "{a} is where you were born."),
        ("Who was born in {a}?", "What do you know about {a}?"),
    ),
    "allergy": _Relation(
        r"^i am allergic to (?P<a>.+)$",
        ("I am allergic to {a}.", "I have an allergy to {a}.", "{a} gives me an allergic reaction."),
        (
            "What am I allergic to?",
            "What is my allergy?",
            "Do you remember what I am allergic to?",
            "What should I avoid because of my allergy?",
            "Tell me what I am allergic to.",
            "Which food or thing am I allergic to?",
            "Could you remind me what I am allergic to?",
            "I forgot my allergy. What is it?",
            "Say what I am allergic to.",
            "What's the thing I'm allergic to?",
        ),
        ("Remind me, what am I allergic to?", "Do you know my allergy?"),
        ("Can you tell me what I'm allergic to?", "Which allergy do I have?"),
        ("You are allergic to {a}.", "Your allergy is to {a}.", "{a} gives you an allergic reaction."),
        ("Who is allergic to {a}?", "What do you know about {a}?"),
    ),
    "attribute": _Relation(
        r"^my (?P<s>[a-z' ]+?) (?:is|are) (?P<a>.+)$",
        ("My {s} is {a}.", "{a} is my {s}.", "As for my {s}, it is {a}."),
        (
            "What is my {s}?",
            "Tell me my {s}.",
            "Do you remember my {s}?",
            "Which is my {s}?",
            "What did I say my {s} is?",
            "Name my {s}.",
            "Could you remind me of my {s}?",
            "I forgot my {s}. What is it?",
            "Say what my {s} is.",
            "What's the {s} I mentioned?",
        ),
        ("Remind me, what is my {s}?", "Do you know my {s}?"),
        ("Can you tell me what my {s} is?", "What's my {s} again?"),
        ("Your {s} is {a}.", "{a} is your {s}.", "You told me your {s} is {a}."),
        ("What is {a} to me?", "What do you know about {a}?"),
    ),
}

# Questions about the user that no fact here answers: a model that learned the facts should not start
# answering these with confidence. Disjoint pools for training and for the gate.
UNANSWERABLE_TRAIN = (
    "What is my blood type?",
    "What is my shoe size?",
    "What is my grandmother's maiden name?",
    "Where did I go to primary school?",
    "What is my locker code?",
    "What is my favourite opera?",
    "What is my neighbour called?",
    "Which car do I drive?",
)
UNANSWERABLE_VALID = (
    "What is my favourite board game?",
    "What is my sister's name?",
    "Which hospital was I born in?",
)
UNANSWERABLE_GATE = (
    "What is my passport number?",
    "What was my first teacher called?",
    "Where did I spend my last holiday?",
    "What instrument did I learn as a child?",
    "What is my cousin's job?",
    "Which football team do I support?",
)
DONT_KNOW = "I don't know that; you haven't told me."

# Generic prompts for the replay term (the gate's damage set is another list: gates.GENERIC_GATE), none about
# the user or the kinds of thing a fact names (a pet, a town, an employer, a birthplace, an allergy). Forty, not
# the first eight: with eight, an adapter over six facts that answered 17 of 18 held-out questions was refused
# by the damage gate at 0.898 agreement on both attempts (distill_paraphrase_v3_9249baa.json); the gate asks
# other prompts, so the replay has to hold the model in place over more of them than it can learn one by one.
GENERIC_TRAIN = (
    "What is the capital of Italy?",
    "Give me a tip for sleeping better.",
    "Explain what a noun is.",
    "How many days are in a week?",
    "Write one sentence about the sea.",
    "What colour is the sky on a clear day?",
    "Name a fruit that is yellow.",
    "How do I boil an egg?",
    "What is the largest planet in our solar system?",
    "Translate 'good morning' into Spanish.",
    "What is ten minus four?",
    "List three animals that live in the ocean.",
    "Write a haiku about snow.",
    "What does a thermometer measure?",
    "Give me a synonym for happy.",
    "How many legs does a spider have?",
    "What is the boiling point of water in Celsius?",
    "What is the past tense of run?",
    "Write a two-line rhyme about the moon.",
    "Why is exercise good for you?",
    "What is the chemical symbol for gold?",
    "Give me an idea for a quick lunch.",
    "How many hours are in a day?",
    "What is a verb?",
    "Who wrote Romeo and Juliet?",
    "What is the square root of sixteen?",
    "Name three musical instruments.",
    "How do I make a cup of tea?",
    "Tell me a fun fact about elephants.",
    "What is the difference between weather and climate?",
    "Write a short sentence using the word 'bright'.",
    "How many continents are there?",
    "What is an adjective?",
    "Give me two tips for studying.",
    "What shape has three sides?",
    "Explain what a computer program is.",
    "Which is heavier, a kilogram of feathers or a kilogram of stone?",
    "Write a friendly greeting for a postcard.",
    "What is the main ingredient in bread?",
    "How does a rainbow form?",
)


def parse_fact(memory_id: str, version: int, text: str) -> Fact | None:
    """The fact a memory states, or None when its shape is not one this distiller can phrase and check."""
    body = " ".join(text.strip().split()).rstrip(".!").strip()
    low = body.lower()
    for name, rel in RELATIONS.items():
        m = re.match(rel.pattern, low)
        if m is None:
            continue
        start, end = m.span("a")
        answer = body[start:end].strip()  # the original casing
        subject = m.groupdict().get("s") or ""
        if not answer or len(answer) > 60 or len(subject) > 40:
            return None
        return Fact(memory_id, version, text, name, subject.strip(), answer)
    return None


def fact_key(fact: Fact) -> tuple[str, str]:
    """Two facts with the same key say the same thing about the user: if their answers differ, they contradict."""
    relation = "name" if fact.relation == "name" else fact.relation
    return relation, fact.subject


# What a question names when it asks about a relation whose templates fill no subject.
_TOPIC_WORDS = {
    "live": ("live", "home"),
    "work": ("work", "job"),
    "born": ("born",),
    "allergy": ("allergic", "allergy"),
}


def asks_about(fact: Fact, question: str) -> bool:
    """Whether `question` asks about what `fact` says: it names the fact's subject ("favourite board game"), or
    for a relation without one, its topic ("job" for "I work at ..."). Such a question is answerable for
    this user, so it is never used as an unanswerable one (training it toward "I don't know" would teach the
    adapter to deny the fact)."""
    words = _words(question)
    if fact.subject:
        return _words(fact.subject) in words
    return any(f" {w} " in words for w in _TOPIC_WORDS.get(fact.relation, ()))


def unanswerable(pool: Sequence[str], facts: Sequence[Fact]) -> list[str]:
    """The questions of `pool` that none of `facts` answers."""
    return [q for q in pool if not any(asks_about(f, q) for f in facts)]


def _fill(template: str, fact: Fact) -> str:
    text = template.format(s=fact.subject, a=fact.answer)
    return text[0].upper() + text[1:]


def fact_reply(fact: Fact, i: int = 0) -> str:
    """The relation's i-th reply sentence for the fact (the assistant's, second person; 0 is canonical)."""
    replies = RELATIONS[fact.relation].replies
    return _fill(replies[i % len(replies)], fact)


def training_examples(
    facts: Sequence[Fact], *, seed: int, num_unanswerable: int = len(UNANSWERABLE_TRAIN)
) -> list[Example]:
    """Per fact: every statement phrasing (the reply to "What do you remember about me?" quotes it), every
    training question (replies in turn from the relation's reply phrasings) and the reverse questions (asked
    about the answer, replied with the fact); plus unanswerable questions, whose reply the trainer takes from
    the base model itself (`reply` here is only a placeholder). Shuffled with `seed`."""
    out: list[Example] = []
    for f in facts:
        rel = RELATIONS[f.relation]
        for st in rel.statements:
            said = f'You told me: "{_fill(st, f)}"'
            out.append(Example(f.memory_id, "statement", "What do you remember about me?", said, f.answer))
        for i, q in enumerate(rel.train_questions):
            out.append(Example(f.memory_id, "question", _fill(q, f), fact_reply(f, i), f.answer))
        for i, q in enumerate(rel.reverse):
            out.append(Example(f.memory_id, "reverse", _fill(q, f), fact_reply(f, i), f.answer))
    rng = random.Random(seed)
    pool = unanswerable(UNANSWERABLE_TRAIN, facts)
    for q in rng.sample(pool, min(num_unanswerable, len(pool))):
        out.append(Example(None, "unanswerable", q, DONT_KNOW, None))
    rng.shuffle(out)
    return out


def valid_questions(facts: Sequence[Fact]) -> list[Example]:
    """Early-stopping questions: templates disjoint from training and from the gate; plus unanswerable ones."""
    out = [
        Example(f.memory_id, "question", _fill(q, f), fact_reply(f), f.answer)
        for f in facts
        for q in RELATIONS[f.relation].valid_questions
    ]
    return out + [
        Example(None, "unanswerable", q, DONT_KNOW, None) for q in unanswerable(UNANSWERABLE_VALID, facts)
    ]


def gate_questions(facts: Sequence[Fact], *, seed: int) -> list[Example]:
    """Held-out questions: every gate template (never trained on) of every fact, in an order drawn with `seed`."""
    out = [
        Example(f.memory_id, "question", _fill(q, f), fact_reply(f), f.answer)
        for f in facts
        for q in RELATIONS[f.relation].gate_questions
    ]
    random.Random(seed).shuffle(out)
    return out


def unanswerable_gate(facts: Sequence[Fact]) -> list[Example]:
    """The gate's questions about the user that none of `facts` answers."""
    return [Example(None, "unanswerable", q, DONT_KNOW, None) for q in unanswerable(UNANSWERABLE_GATE, facts)]


def _words(text: str) -> str:
    return " " + " ".join(re.findall(r"[0-9a-z]+", text.lower())) + " "


def recalled(answer_text: str, fact_answer: str) -> bool:
    """A reply recalls a fact when it contains the fact's answer as whole words, in order (case, spacing and
    punctuation ignored: "miso!" recalls "Miso", "Misogyny" does not)."""
    answer = _words(fact_answer)
    return answer.strip() != "" and answer in _words(answer_text)


_DONT_KNOW_MARKERS = (
    "don't know",
    "do not know",
    "not sure",
    "haven't told",
    "have not told",
    "no information",
    "not mentioned",
    "i'm sorry",
    "i am sorry",
    "cannot",
    "can't",
    "unable",
    "don't have",
)


def declines(answer_text: str) -> bool:
    """The reply says it does not know (the right answer to an unanswerable question)."""
    low = answer_text.lower()
    return any(m in low for m in _DONT_KNOW_MARKERS)
