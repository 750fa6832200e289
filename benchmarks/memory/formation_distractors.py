"""The distractor supersession cases: histories in which nothing may be superseded (a trip, a friend elsewhere,
a second pet, a hypothetical, a question, another person's news, ...).

Each generator says its turns into a case's history and returns (current facts, superseded facts: none).
Knows nothing of any extractor; the categories and their order are formation_supersession.py's.
"""

from __future__ import annotations

import random
from datetime import timedelta

from benchmarks.memory.formation_data import (
    CITIES,
    COMPANIES,
    JOBS,
    NAMES,
    OBJECTS,
    PET_NAMES,
    SPECIES,
    _article,
    _History,
    _monday,
    _month_name,
    _pick,
)

# ---- distractors: nothing may be superseded -------------------------------------------------------------


def _trip(rng: random.Random, h: _History) -> tuple[list[str], list[str]]:
    a, b = _pick(rng, CITIES, 2)
    h.say(f"I live in {a}.")
    gap = rng.randint(10, 100)
    said = (h.now + timedelta(days=gap)).date()
    second, new = rng.choice(
        (
            (
                f"I'm flying to {b} next week for a conference.",
                f"I'm flying to {b} in the week of {_monday(said) + timedelta(days=7)} for a conference",
            ),
            (
                f"I spent last weekend in {b}.",
                f"I spent the weekend of {_monday(said) - timedelta(days=2)} in {b}",
            ),
            (f"We're going to {b} in May.", f"We're going to {b} in May"),
            (f"I visited {b} last month.", f"I visited {b} in {_month_name(said, 1)}"),
        )
    )
    h.say(second, after_days=gap)
    return [f"I live in {a}", new], []


def _friend_elsewhere(rng: random.Random, h: _History) -> tuple[list[str], list[str]]:
    a, b = _pick(rng, CITIES, 2)
    friend = rng.choice(NAMES)
    h.say(f"I live in {a}.")
    second = rng.choice(
        (
            f"My best friend lives in {b}.",
            f"My friend {friend} just moved to {b}.",
            f"My parents live in {b}.",
            f"My sister lives in {b}.",
        )
    )
    h.say(second, after_days=rng.randint(1, 60))
    return [f"I live in {a}", second.rstrip(".")], []


def _origin(rng: random.Random, h: _History) -> tuple[list[str], list[str]]:
    a, b = _pick(rng, CITIES, 2)
    h.say(f"I live in {a}.")
    second = rng.choice(
        (f"I'm from {b}.", f"I grew up in {b}.", f"I'm originally from {b}.", f"I was born in {b}.")
    )
    h.say(second, after_days=rng.randint(1, 60))
    return [f"I live in {a}", second.rstrip(".")], []


def _second_like(rng: random.Random, h: _History) -> tuple[list[str], list[str]]:
    (o1, _), (o2, _) = rng.sample(OBJECTS, 2)
    h.say(f"I love {o1}.")
    second = rng.choice((f"I also love {o2}.", f"I really enjoy {o2} too.", f"I'm into {o2} as well."))
    h.say(second, after_days=rng.randint(1, 60))
    return [f"I love {o1}", second.rstrip(".")], []


def _second_pet(rng: random.Random, h: _History) -> tuple[list[str], list[str]]:
    s1, s2 = _pick(rng, SPECIES, 2)
    n1, n2 = _pick(rng, PET_NAMES, 2)
    h.say(f"I have a {s1} named {n1}.")
    second = rng.choice(
        (
            f"We also have a {s2} called {n2}.",
            f"I just adopted a {s2} named {n2}.",
            f"My {s2} is called {n2}.",
        )
    )
    h.say(second, after_days=rng.randint(1, 120))
    return [f"I have a {s1} named {n1}", second.rstrip(".")], []


def _hypothetical(rng: random.Random, h: _History) -> tuple[list[str], list[str]]:
    a, b = _pick(rng, CITIES, 2)
    j = rng.choice(JOBS)
    h.say(f"I live in {a}.")
    second = rng.choice(
        (
            f"If I could live anywhere, I'd pick {b}.",
            f"Maybe I should move to {b}.",
            f"I might move to {b} one day.",
            "If I were rich I'd quit my job.",
            f"Sometimes I wish I was {_article(j)} {j}.",
            f"I would love to live in {b} if I could afford it.",
        )
    )
    h.say(second, after_days=rng.randint(1, 60))
    return [f"I live in {a}"], []


def _question(rng: random.Random, h: _History) -> tuple[list[str], list[str]]:
    a, b = _pick(rng, CITIES, 2)
    h.say(f"I live in {a}.")
    second = rng.choice(
        (
            f"What's it like to live in {b}?",
            f"Do you think I should move to {b}?",
            f"Is {b} a good place for families?",
            f"Can you tell me about the job market in {b}?",
            "Should I quit my job?",
        )
    )
    h.say(second, after_days=rng.randint(1, 60))
    return [f"I live in {a}"], []


def _past_home(rng: random.Random, h: _History) -> tuple[list[str], list[str]]:
    a, b = _pick(rng, CITIES, 2)
    h.say(f"I live in {a}.")
    second = rng.choice((f"I used to live in {b}.", f"I lived in {b} for two years when I was younger."))
    h.say(second, after_days=rng.randint(1, 60))
    return [f"I live in {a}", second.rstrip(".")], []


def _other_person(rng: random.Random, h: _History) -> tuple[list[str], list[str]]:
    j1, j2 = _pick(rng, JOBS, 2)
    c1, c2 = _pick(rng, COMPANIES, 2)
    first, second = rng.choice(
        (
            (f"I'm {_article(j1)} {j1}.", f"My husband is {_article(j2)} {j2}."),
            (f"I work at {c1}.", f"My sister works at {c2}."),
            ("I'm married.", "My sister just got engaged!"),
            ("I'm vegetarian.", "My husband eats meat though."),
            (
                f"I have a dog named {rng.choice(PET_NAMES)}.",
                f"My neighbour's dog is called {rng.choice(PET_NAMES)}.",
            ),
        )
    )
    h.say(first)
    h.say(second, after_days=rng.randint(1, 60))
    return [first.rstrip("."), second.rstrip(".!").replace(" though", "")], []


def _about_assistant(rng: random.Random, h: _History) -> tuple[list[str], list[str]]:
    obj, _ = rng.choice(OBJECTS)
    h.say(f"I love {obj}.")
    h.say(rng.choice(("I love how you explain things!", "I like your answers.", "You're really helpful.")), 1)
    return [f"I love {obj}"], []
