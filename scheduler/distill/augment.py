"""Knowledge augmentation before distillation: each fact restated in more wordings and asked in more ways than
data.py's training templates, as Allen-Zhu and Li (Physics of Language Models 3.1) found a fact must be seen
to be extractable when asked differently: facts trained in one phrasing are stored but not retrieved.

Templates keyed on the fact's shape (data.RELATIONS: "name", "live", ...), each question asked under two
framings ("Quick question: ..."), then each situation (the fact needed for something the user is doing: a letter
to address, a name to call) once, every other one after a sentence of context; replies alternate a full
sentence and the bare answer. Every prompt made here is disjoint from data.py's validation and gate templates (the gates stay honest; a test checks it).
Pure: no model, no store. The served model's own questions are model_augment.py's (`--distill-augment model`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from scheduler.distill.data import RELATIONS, Example, Fact


@dataclass(frozen=True)
class _Augment:
    asks: tuple[str, ...]  # questions about the fact, "{s}" subject
    says: tuple[str, ...]  # the fact restated in the user's words, "{s}" subject, "{a}" answer
    replies: tuple[str, ...]  # the assistant's answers, second person; alternated with the bare answer
    # the fact needed inside a situation the user describes (a letter to send, a name to call), each asked once,
    # every other one after a sentence of context (CONTEXTS)
    situations: tuple[str, ...] = ()


# Prompts asking for what the user said about themselves; each restatement is the reply to one of them.
RECALL_PROMPTS = (
    "What do you know about me?",
    "Tell me something I told you about myself.",
    "Summarise what I've shared with you.",
    "What have I said about my life?",
    "Which facts about me do you have?",
)

# Framings a question is asked under (each question under two: its index and the next).
FRAMINGS = (
    "",
    "Quick question: ",
    "Hey, ",
    "Sorry, I forget things. ",
    "One more thing: ",
    "Random question, ",
)

# A sentence of the user's own before a situation's question, on every other one: a question comes with context
CONTEXTS = (
    "I'm sorting out a few things today. ",
    "Before I forget, ",
    "This might sound odd, but ",
    "I'm a bit scatterbrained this week. ",
)

AUGMENTS: dict[str, _Augment] = {
    "name": _Augment(
        (
            "What name does my {s} go by?",
            "My {s}, what was the name again?",
            "Which name did I give my {s}?",
            "How is my {s} called?",
            "Do you know the name of my {s}?",
            "What do people call my {s}?",
            "I'm writing a card for my {s}. Which name goes on it?",
            "Can you say my {s}'s name?",
            "A friend asked about my {s}. What is its name?",
            "Name of my {s}, please.",
        ),
        (
            "My {s} is called {a}.",
            "I have a {s} named {a}.",
            "{a} is what I call my {s}.",
            "The name of my {s} is {a}.",
        ),
        ("Your {s} is called {a}.", "Your {s}'s name is {a}.", "You named your {s} {a}."),
        (
            "If I were calling my {s} over, which name would I use?",
            "I'm telling a story about my {s}. What name do I use?",
            "My {s} just did something funny. What's the name again?",
            "Someone asked who my {s} is. Which name do I give?",
            "I'm labelling a photo of my {s}. What name do I write?",
            "what did we say my {s} goes by",
        ),
    ),
    "live": _Augment(
        (
            "Which city is my home in?",
            "Where am I based?",
            "Where do I reside?",
            "What's my city?",
            "Which place do I call home?",
            "I'm filling in a form. What city do I live in?",
            "Where is my flat?",
            "Home for me is which town?",
            "What is the town where I have my home?",
            "Where do I stay?",
        ),
        ("I live in {a}.", "I'm based in {a}.", "Home for me is {a}.", "I reside in {a}."),
        ("You live in {a}.", "You're based in {a}.", "Your home is in {a}."),
        (
            "If a friend wanted to visit me at home, which town would they go to?",
            "Where should a letter to me be sent?",
            "I'm heading home after a trip. Which town am I going back to?",
            "Where would someone find my house?",
            "Which town do I live in these days?",
            "someone asked where I'm living now, what do I say",
        ),
    ),
    "work": _Augment(
        (
            "Where's my workplace?",
            "Which company employs me?",
            "Where am I employed?",
            "I'm filling in a form. Who is my employer?",
            "Which business do I work at?",
            "Where do I spend my working days?",
            "What is the name of my workplace?",
            "At which place do I have my job?",
            "Who gives me work?",
            "Where is my job these days?",
        ),
        ("I work at {a}.", "I'm employed by {a}.", "My job is at {a}.", "{a} employs me."),
        ("You work at {a}.", "You're employed by {a}.", "Your job is at {a}."),
        (
            "Where do I head each weekday for my job?",
            "If my boss rings, which company is calling?",
            "I'm updating my CV. What's my current workplace?",
            "Which business pays my wages?",
            "Where would a colleague of mine be working?",
            "what place do I work at again",
        ),
    ),
    "born": _Augment(
        (
            "Where's my birthplace?",
            "Which town was I born in?",
            "Where did I come into the world?",
            "I'm filling in a form. Place of birth?",
            "Where is my place of origin?",
            "In which place was I born?",
            "Which city saw my birth?",
            "Where was my birth?",
            "Where do my roots lie?",
            "What's the town of my birth?",
        ),
        ("I was born in {a}.", "{a} is my birthplace.", "My place of birth is {a}.", "I come from {a}."),
        ("You were born in {a}.", "Your birthplace is {a}.", "You come from {a}."),
        (
            "If I visited the town I was born in, where would I go?",
            "What place is written on my birth certificate?",
            "Where did my life begin?",
            "I'm telling someone where I was born. What do I say?",
            "Which town would my first baby photos be from?",
            "my place of birth, what was it",
        ),
    ),
    "allergy": _Augment(
        (
            "What gives me an allergic reaction?",
            "Which thing must I avoid because of an allergy?",
            "What triggers my allergy?",
            "I'm filling in a form. Any allergies?",
            "What am I allergic to, again?",
            "Is there something I'm allergic to?",
            "What should a cook keep away from me?",
            "Which allergy do I suffer from?",
            "What makes me react badly?",
            "Name my allergy.",
        ),
        (
            "I am allergic to {a}.",
            "I react badly to {a}.",
            "My allergy is to {a}.",
            "{a} triggers my allergy.",
        ),
        ("You are allergic to {a}.", "You react badly to {a}.", "Your allergy is to {a}."),
        (
            "I'm ordering at a restaurant. What should I tell the waiter I'm allergic to?",
            "My friend is cooking for me. What must they leave out?",
            "What's written on my allergy card?",
            "Which thing makes me ill if I touch or eat it?",
            "What do I have to stay away from at parties?",
            "what am i allergic to again",
        ),
    ),
    "attribute": _Augment(
        (
            "What's my {s}?",
            "My {s}, what is it?",
            "I'm filling in a form. What is my {s}?",
            "Which one is my {s}?",
            "What would you say my {s} is?",
            "Do you know what my {s} is?",
            "What is my {s}, again?",
            "Name of my {s}, please.",
            "Which is the {s} I told you about?",
            "Tell me, what's my {s}?",
        ),
        ("My {s} is {a}.", "{a} is my {s}.", "When it comes to my {s}, it's {a}.", "I'd say my {s} is {a}."),
        ("Your {s} is {a}.", "{a} is your {s}.", "You said your {s} is {a}."),
        (
            "If someone wanted to know my {s}, what would I tell them?",
            "I'm filling in a profile. What do I put for my {s}?",
            "Someone asked about my {s}. What's the answer?",
            "I'm writing about myself. What is my {s}?",
            "Which one did I say is my {s}?",
            "my {s}? what was it",
        ),
    ),
}
assert set(AUGMENTS) == set(RELATIONS), "every shape data.py parses has augmentation templates"


def _fill(template: str, fact: Fact) -> str:
    text = template.format(s=fact.subject, a=fact.answer)
    return text[0].upper() + text[1:]


def _reply(aug: _Augment, fact: Fact, k: int) -> str:
    """The k-th of the relation's reply sentences (in turn), filled."""
    return _fill(aug.replies[k % len(aug.replies)], fact)


def _framed(framing: str, question: str) -> str:
    """The question after a framing: lower-cased after one that ends mid-sentence (not on ".", "?", "!"), except
    "I"."""
    if framing and not framing.rstrip().endswith((".", "?", "!")) and not question.startswith(("I ", "I'")):
        question = question[0].lower() + question[1:]
    return framing + question


def augmented_examples(facts: Sequence[Fact]) -> list[Example]:
    """Per fact, in this order: each restatement as the reply to a recall prompt (the i-th to RECALL_PROMPTS[i];
    kind "statement"), then each question under framings i and i+1 (kind "question"), replied in turn with
    the relation's reply sentences (even positions) and the bare answer (odd). Deterministic: no seed."""
    out: list[Example] = []
    for f in facts:
        aug = AUGMENTS[f.relation]
        for i, say in enumerate(aug.says):
            prompt = RECALL_PROMPTS[i % len(RECALL_PROMPTS)]
            out.append(Example(f.memory_id, "statement", prompt, f'You told me: "{_fill(say, f)}"', f.answer))
        n = 0
        for i, ask in enumerate(aug.asks):
            for framing in (FRAMINGS[i % len(FRAMINGS)], FRAMINGS[(i + 1) % len(FRAMINGS)]):
                reply = _reply(aug, f, n // 2) if n % 2 == 0 else f"{f.answer}."
                out.append(Example(f.memory_id, "question", _framed(framing, _fill(ask, f)), reply, f.answer))
                n += 1
        for i, situation in enumerate(aug.situations):
            framing = CONTEXTS[(i // 2) % len(CONTEXTS)] if i % 2 else ""
            reply = _reply(aug, f, i) if i % 2 == 0 else f"{f.answer}."
            out.append(
                Example(f.memory_id, "question", _framed(framing, _fill(situation, f)), reply, f.answer)
            )
    return out
