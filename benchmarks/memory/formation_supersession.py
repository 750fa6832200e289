"""The supersession cases: a short history of user turns and which facts are current and which were superseded
at the end (a move, a new job, a changed preference, a correction, ...), with the distractors' categories.

Each generator says its turns into a case's history and returns (current facts, superseded facts);
`supersession_cases` draws every category in a fixed order from one seed. Knows nothing of any extractor.
"""

from __future__ import annotations

import random
from datetime import timedelta

from benchmarks.memory.formation_data import (
    ACTIVITIES,
    CITIES,
    COLOURS,
    COMPANIES,
    COUNTRIES,
    FOODS,
    JOBS,
    NAMES,
    OBJECTS,
    PET_NAMES,
    SEED,
    SPECIES,
    SupersessionCase,
    _article,
    _History,
    _last_weekday,
    _monday,
    _month_name,
    _pick,
    _start,
)
from benchmarks.memory.formation_distractors import (
    _about_assistant,
    _friend_elsewhere,
    _hypothetical,
    _origin,
    _other_person,
    _past_home,
    _question,
    _second_like,
    _second_pet,
    _trip,
)

# ---- supersession cases ----------------------------------------------------------------------------------
# Each generator returns (category, distractor, turns, current, superseded) for one random draw.


def _move(rng: random.Random, h: _History) -> tuple[list[str], list[str]]:
    a, b = _pick(rng, CITIES + list(COUNTRIES), 2)
    first = rng.choice(
        (f"I live in {a}.", f"I'm based in {a} these days.", f"We live in {a}.", f"I currently live in {a}.")
    )
    h.say(first)
    old = first.rstrip(".")
    gap = rng.randint(20, 200)
    said = h.now + timedelta(days=gap)
    month = _month_name(said.date(), 1)
    second, new = rng.choice(
        (
            (f"I moved to {b} last month.", f"I moved to {b} in {month}"),
            (f"Big news: I just moved to {b}!", f"I just moved to {b}"),
            (f"We relocated to {b}.", f"We relocated to {b}"),
            (f"I live in {b} now.", f"I live in {b} now"),
            (f"Update: I'm now living in {b}.", f"I'm now living in {b}"),
            (f"After years in {a}, I finally moved to {b}.", f"After years in {a}, I finally moved to {b}"),
            (f"I've moved to {b}, the new flat is tiny.", f"I've moved to {b}"),
        )
    )
    h.say(second, after_days=gap)
    return [new], [old]


def _relative_move(rng: random.Random, h: _History) -> tuple[list[str], list[str]]:
    rel = rng.choice(("sister", "brother", "mom", "dad", "best friend"))
    a, b = _pick(rng, CITIES, 2)
    h.say(f"My {rel} lives in {a}.")
    old = f"My {rel} lives in {a}"
    gap = rng.randint(20, 200)
    said = (h.now + timedelta(days=gap)).date()
    second, new = rng.choice(
        (
            (f"My {rel} moved to {b} last year.", f"My {rel} moved to {b} in {said.year - 1}"),
            (f"My {rel} just moved to {b}.", f"My {rel} just moved to {b}"),
            (f"My {rel} is living in {b} now.", f"My {rel} is living in {b} now"),
        )
    )
    h.say(second, after_days=gap)
    return [new], [old]


def _job(rng: random.Random, h: _History) -> tuple[list[str], list[str]]:
    j1, j2 = _pick(rng, JOBS, 2)
    c1, c2 = _pick(rng, COMPANIES, 2)
    kind = rng.randrange(4)
    if kind == 0:  # job title changes
        first = rng.choice((f"I work as {_article(j1)} {j1}.", f"I'm {_article(j1)} {j1}."))
        h.say(first)
        second, new = rng.choice(
            (
                (f"I'm now {_article(j2)} {j2}.", f"I'm now {_article(j2)} {j2}"),
                (f"I retrained and now work as {_article(j2)} {j2}.", f"I now work as {_article(j2)} {j2}"),
                (f"I got a new job as {_article(j2)} {j2}!", f"I got a new job as {_article(j2)} {j2}"),
            )
        )
        h.say(second, after_days=rng.randint(30, 300))
        return [new], [first.rstrip(".")]
    if kind == 1:  # employer changes
        first = rng.choice((f"I work at {c1}.", f"I work for {c1}."))
        h.say(first)
        gap = rng.randint(30, 300)
        said = (h.now + timedelta(days=gap)).date()
        second, new = rng.choice(
            (
                (f"I got a job at {c2}!", f"I got a job at {c2}"),
                (
                    f"I started working at {c2} last week.",
                    f"I started working at {c2} in the week of {_monday(said) - timedelta(days=7)}",
                ),
                (f"I'm working for {c2} now.", f"I'm working for {c2} now"),
            )
        )
        h.say(second, after_days=gap)
        return [new], [first.rstrip(".")]
    if kind == 2:  # quits: the employer is retired too
        first = f"I work at {c1}."
        h.say(first)
        second = rng.choice(("I quit my job.", "I lost my job last week.", "I got laid off."))
        day = h.say(second, after_days=rng.randint(30, 300))
        new = second.rstrip(".").replace("last week", f"in the week of {_monday(day) - timedelta(days=7)}")
        return [new], [first.rstrip(".")]
    first = f"I'm {_article(j1)} {j1}."  # quits a job title
    h.say(first)
    second = rng.choice(
        ("I quit my job yesterday.", "I'm unemployed at the moment.", "I retired last month.")
    )
    day = h.say(second, after_days=rng.randint(30, 300))
    new = (
        second.rstrip(".")
        .replace("yesterday", f"on {day - timedelta(days=1)}")
        .replace("last month", f"in {_month_name(day, 1)}")
    )
    return [new], [first.rstrip(".")]


def _preference(rng: random.Random, h: _History) -> tuple[list[str], list[str]]:
    obj, verb = rng.choice(OBJECTS + tuple((a, v) for a, v in ACTIVITIES))
    is_activity = (obj, verb) in ACTIVITIES
    if rng.random() < 0.7:  # love -> no longer
        first = rng.choice((f"I love {obj}.", f"I really like {obj}.", f"I'm a huge fan of {obj}."))
        h.say(first)
        options = [
            f"I don't {verb} {obj} anymore." if not is_activity else f"I don't {verb} anymore.",
            f"I can't stand {obj} these days.",
            f"I've gone off {obj}.",
            f"I hate {obj} now.",
        ]
        if verb in ("drink", "eat"):
            options.append(f"I stopped {'drinking' if verb == 'drink' else 'eating'} {obj}.")
        second = rng.choice(options)
        h.say(second, after_days=rng.randint(10, 200))
        return [second.rstrip(".")], [first.rstrip(".")]
    first = rng.choice((f"I hate {obj}.", f"I don't like {obj}.", f"I can't stand {obj}."))
    h.say(first)
    second = rng.choice(
        (f"I love {obj} now.", f"I've started to really enjoy {obj}.", f"These days I like {obj}.")
    )
    h.say(second, after_days=rng.randint(10, 200))
    return [second.rstrip(".")], [first.rstrip(".")]


def _pet(rng: random.Random, h: _History) -> tuple[list[str], list[str]]:
    species = rng.choice(SPECIES)
    n1, n2 = _pick(rng, PET_NAMES, 2)
    first = rng.choice(
        (f"I have a {species} named {n1}.", f"My {species} is called {n1}.", f"My {species}'s name is {n1}.")
    )
    h.say(first)
    kind = rng.randrange(3)
    if kind == 0:
        second, new = rng.choice(
            (
                (
                    f"Actually, my {species} is called {n2}, not {n1}.",
                    f"My {species} is called {n2}, not {n1}",
                ),
                (f"Sorry, I mixed that up: my {species}'s name is {n2}.", f"My {species}'s name is {n2}"),
            )
        )
        h.say(second, after_days=0)
    elif kind == 1:
        second = rng.choice((f"My {species} passed away last month.", f"Sadly my {species} {n1} died."))
        day = h.say(second, after_days=rng.randint(60, 300))
        new = second.rstrip(".").replace("last month", f"in {_month_name(day, 1)}").replace("Sadly m", "M")
    else:
        young = {"dog": "puppy", "cat": "kitten"}.get(species, species)
        second, new = rng.choice(
            (
                (f"We adopted a new {young} named {n2}.", f"We adopted a new {young} named {n2}"),
                (f"I got a new {species} called {n2}!", f"I got a new {species} called {n2}"),
            )
        )
        h.say(second, after_days=rng.randint(60, 300))
    return [new], [first.rstrip(".")]


def _relationship(rng: random.Random, h: _History) -> tuple[list[str], list[str]]:
    partner = rng.choice(("girlfriend", "boyfriend", "partner"))
    name = rng.choice(NAMES)
    steps = rng.choice(
        (
            ("I'm single.", rng.choice(("I'm seeing someone now.", f"I have a {partner} now."))),
            (
                f"I have a {partner}.",
                rng.choice(("We broke up last week.", f"I broke up with my {partner}.")),
            ),
            ("I'm engaged!", rng.choice(("We got married last Saturday!", "I got married."))),
            ("I'm married.", rng.choice(("I got divorced last year.", "I'm divorced now."))),
            ("I'm single.", "I just got engaged!"),
        )
    )
    first, second = steps
    h.say(first)
    if rng.random() < 0.3 and first.startswith("I have a"):  # the partner's name is retired too
        h.say(f"My {partner}'s name is {name}.")
        day = h.say(f"I broke up with {name}.", after_days=rng.randint(30, 300))
        return [f"I broke up with {name}"], [first.rstrip("."), f"My {partner}'s name is {name}"]
    day = h.say(second, after_days=rng.randint(30, 300))
    sat = _last_weekday(day, 5)
    new = (
        second.rstrip(".!")
        .replace("last week", f"in the week of {_monday(day) - timedelta(days=7)}")
        .replace("last Saturday", f"on {sat}")
        .replace("last year", f"in {day.year - 1}")
    )
    return [new], [first.rstrip(".!")]


def _correction(rng: random.Random, h: _History) -> tuple[list[str], list[str]]:
    kind = rng.randrange(5)
    if kind == 0:
        a, b = _pick(rng, CITIES, 2)
        first, second = (
            f"I live in {a}.",
            rng.choice(
                (
                    f"Sorry, I meant I live in {b}, not {a}.",
                    f"Correction: I live in {b}.",
                    f"Wait, no, I live in {b}.",
                )
            ),
        )
        new = f"I live in {b}" + (f", not {a}" if "not" in second else "")
    elif kind == 1:
        age = rng.randint(22, 60)
        first, second = f"I'm {age}.", f"Actually I'm {age + 1}, not {age}."
        new = f"I'm {age + 1}, not {age}"
    elif kind == 2:
        c1, c2 = _pick(rng, COLOURS, 2)
        first, second = f"My favourite colour is {c1}.", f"Actually, my favourite colour is {c2}."
        new = f"My favourite colour is {c2}"
    elif kind == 3:
        n1, n2 = _pick(rng, NAMES, 2)
        first, second = (
            f"My name is {n1}.",
            rng.choice((f"Actually, call me {n2}.", f"Oops, my name is {n2}.")),
        )
        new = second.rstrip(".").replace("Actually, c", "C").replace("Oops, m", "M")
    else:
        rel = rng.choice(("sister", "brother", "aunt"))
        a, b = _pick(rng, CITIES, 2)
        first, second = f"My {rel} lives in {a}.", f"Correction: my {rel} lives in {b}."
        new = f"My {rel} lives in {b}"
    h.say(first)
    h.say(second, after_days=0)
    return [new], [first.rstrip(".")]


def _diet(rng: random.Random, h: _History) -> tuple[list[str], list[str]]:
    first, second = rng.choice(
        (
            ("I'm vegetarian.", "I started eating meat again."),
            ("I'm vegetarian.", "I'm not vegetarian anymore."),
            ("I'm a vegetarian.", "I went vegan last month."),
            ("I'm vegan.", "I'm pescatarian now."),
            ("I've been vegan for two years.", "I eat meat again."),
            ("I'm vegan.", "I'm no longer vegan."),
        )
    )
    h.say(first)
    day = h.say(second, after_days=rng.randint(30, 300))
    return [second.rstrip(".").replace("last month", f"in {_month_name(day, 1)}")], [first.rstrip(".")]


def _favourite(rng: random.Random, h: _History) -> tuple[list[str], list[str]]:
    thing, pool = rng.choice((("colour", COLOURS), ("food", FOODS)))
    a, b = _pick(rng, pool, 2)
    first = rng.choice((f"My favourite {thing} is {a}.", f"{a.capitalize()} is my favourite {thing}."))
    h.say(first)
    second = rng.choice(
        (
            f"My favourite {thing} is now {b}.",
            f"{b.capitalize()} is my new favourite {thing}.",
            f"These days my favourite {thing} is {b}.",
        )
    )
    h.say(second, after_days=rng.randint(10, 200))
    return [second.rstrip(".")], [first.rstrip(".")]


SUPERSESSION_GENERATORS = {
    "move": (_move, False),
    "relative_move": (_relative_move, False),
    "job": (_job, False),
    "preference": (_preference, False),
    "pet": (_pet, False),
    "relationship": (_relationship, False),
    "correction": (_correction, False),
    "diet": (_diet, False),
    "favourite": (_favourite, False),
    "distractor_trip": (_trip, True),
    "distractor_friend": (_friend_elsewhere, True),
    "distractor_origin": (_origin, True),
    "distractor_second_like": (_second_like, True),
    "distractor_second_pet": (_second_pet, True),
    "distractor_hypothetical": (_hypothetical, True),
    "distractor_question": (_question, True),
    "distractor_past": (_past_home, True),
    "distractor_other_person": (_other_person, True),
    "distractor_about_assistant": (_about_assistant, True),
}


def supersession_cases(seed: int = SEED, per_category: int = 16) -> list[SupersessionCase]:
    """`per_category` cases of each category (19 categories: 304 cases at the default), in a fixed order."""
    rng = random.Random(seed)
    cases = []
    for category, (generate, distractor) in SUPERSESSION_GENERATORS.items():
        for k in range(per_category):
            case_id = f"sup-{category}-{k}"
            history = _History(rng, case_id, _start(rng))
            current, superseded = generate(rng, history)
            cases.append(
                SupersessionCase(
                    case_id, category, distractor, tuple(history.turns), tuple(current), tuple(superseded)
                )
            )
    return cases
