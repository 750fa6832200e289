"""Synthetic, labelled chat turns for evaluating memory formation: extraction cases (turns -> the atomic facts
they state) and supersession cases (a short history of user turns -> which facts are current and which were
superseded at the end), each built from templates with varied wording and a fixed seed.

All text is written here and in data/formation_templates.json (the phrasing templates, as data). Knows nothing
of any extractor: the expected facts and the resolved dates are computed by this module's own calendar code,
not by kvmem.formation.dates.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from datetime import date, datetime, timedelta, timezone
from pathlib import Path

from kvmem.formation.types import TurnInput

SEED = 20261126


def _tuples(value):
    """JSON lists back as the tuples the templates are (nested)."""
    if isinstance(value, list):
        return tuple(_tuples(v) for v in value)
    if isinstance(value, dict):
        return {k: _tuples(v) for k, v in value.items()}
    return value


# the phrasing templates (messages with {fields}, and the facts they state), kept as data
_TEMPLATES = _tuples(json.loads((Path(__file__).resolve().parents[1] / "data" / "formation_templates.json").read_text()))
_WEEKDAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
_MONTHS = "January February March April May June July August September October November December".split()


@dataclass(frozen=True)
class ExtractionCase:
    """Turns and the atomic facts they state (first person, relative dates resolved); `date_phrases`: the
    absolute phrases ("on 2026-11-25") the facts must contain, for cases with a relative date."""

    id: str
    category: str
    turns: tuple[TurnInput, ...]
    expected: tuple[str, ...]
    date_phrases: tuple[str, ...] = ()


@dataclass(frozen=True)
class SupersessionCase:
    """A history of turns and the memories after it: the fact texts still current and those superseded.
    `distractor`: nothing in it should supersede anything."""

    id: str
    category: str
    distractor: bool
    turns: tuple[TurnInput, ...]
    current: tuple[str, ...]
    superseded: tuple[str, ...]


# ---- vocabulary ------------------------------------------------------------------------------------------

CITIES = (
    "Lisbon Berlin Madrid Porto Rome Oslo Vienna Prague Dublin Warsaw Lyon Munich Seattle Denver Austin "
    "Toronto Chicago Boston Melbourne Osaka Kyoto Nairobi Bogota Lima Helsinki Zurich Krakow Seville "
    "Valencia Hamburg Copenhagen Stockholm Edinburgh Glasgow Leeds Bristol Auckland Montreal Athens"
).split() + ["New York", "San Diego", "Buenos Aires", "Cape Town", "Mexico City", "Hong Kong", "Tel Aviv"]
COUNTRIES = (
    "Portugal",
    "Germany",
    "Spain",
    "Canada",
    "Japan",
    "Brazil",
    "Norway",
    "Ireland",
    "Italy",
    "Kenya",
)
JOBS = (
    "nurse",
    "teacher",
    "software engineer",
    "graphic designer",
    "accountant",
    "pharmacist",
    "chef",
    "data analyst",
    "lawyer",
    "architect",
    "physiotherapist",
    "electrician",
    "journalist",
    "product manager",
    "dentist",
    "librarian",
)
COMPANIES = (
    "Siemens",
    "Spotify",
    "Google",
    "a local bakery",
    "the city hospital",
    "Deloitte",
    "Shopify",
    "IKEA",
    "a small startup",
    "Nokia",
    "Airbus",
    "the public library",
    "Unilever",
)
NAMES = "Ana Ben Cleo Dev Eli Farah Gus Hana Ivan Jade Kai Lena Milo Nina Omar Pia Rui Sara Tomas Uma".split()
PET_NAMES = (
    "Max Rex Luna Biscuit Pepper Mochi Olive Ziggy Nala Bruno Coco Pixel Tofu Juno Rocky Ginger".split()
)
COLOURS = ("blue", "green", "red", "yellow", "purple", "orange", "black", "teal")
FOODS = ("sushi", "pizza", "ramen", "tacos", "curry", "lasagna", "paella", "dumplings")
# (object, verb for "I don't <verb> <object> anymore")
OBJECTS = (
    ("coffee", "drink"),
    ("green tea", "drink"),
    ("red wine", "drink"),
    ("beer", "drink"),
    ("spicy food", "eat"),
    ("chocolate", "eat"),
    ("sushi", "eat"),
    ("video games", "play"),
    ("board games", "play"),
    ("tennis", "play"),
    ("horror movies", "watch"),
    ("reality TV", "watch"),
    ("jazz", "listen to"),
    ("country music", "listen to"),
    ("podcasts", "listen to"),
)
ACTIVITIES = (
    ("running", "run"),
    ("hiking", "hike"),
    ("swimming", "swim"),
    ("cooking", "cook"),
    ("yoga", "do yoga"),
)
RELATIVES = ("sister", "brother", "mom", "dad", "cousin Ana", "aunt", "daughter", "son")
SPECIES = ("dog", "cat", "rabbit", "parrot", "hamster")
EVENTS_PAST = (
    "went to the dentist",
    "ran my first half marathon",
    "visited my grandparents",
    "started a pottery class",
    "finished reading a long novel",
    "painted the kitchen",
    "went to a jazz concert",
    "baked bread for the first time",
)
PLANS = (
    "fly to Madrid",
    "start a new course",
    "see my sister",
    "go to a wedding",
    "have a job interview",
    "move into the new flat",
)


# ---- calendar (independent of kvmem.formation.dates) -----------------------------------------------------


def _iso(moment: datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _monday(day: date) -> date:
    return day - timedelta(days=day.weekday())


def _month_name(day: date, months_back: int) -> str:
    index = day.year * 12 + day.month - 1 - months_back
    return f"{_MONTHS[index % 12]} {index // 12}"


def _last_weekday(day: date, weekday: int) -> date:
    back = (day.weekday() - weekday) % 7 or 7
    return day - timedelta(days=back)


# ---- building turns -------------------------------------------------------------------------------------

_USER_FILLER = (
    "hey!",
    "thanks!",
    "ok cool",
    "lol",
    "sounds good",
    "Good morning!",
    "Thank you so much, that helps.",
    "Can you help me plan my week?",
    "What should I cook tonight?",
    "Tell me a fun fact.",
    "haha nice",
    "Could you recommend a good podcast?",
    "I see.",
)
_ASSISTANT = (
    "That sounds exciting! How are you settling in?",
    "Of course. What would you like to start with?",
    "I live in the cloud, so no commute for me.",
    "Here is a simple plan: start with the most urgent task.",
    "I love that idea! Tell me more.",
    "Great question. Many people enjoy a short walk after dinner.",
    "I'm a language model, but I'm happy to help.",
)


class _History:
    """Turns of one case, with the clock moving forward; `say` returns the turn's time."""

    def __init__(self, rng: random.Random, case_id: str, start: datetime, filler: bool = True) -> None:
        self.rng, self.case_id, self.now, self.filler = rng, case_id, start, filler
        self.turns: list[TurnInput] = []

    def _add(self, role: str, text: str, speaker: str | None = None) -> None:
        turn_id = f"{self.case_id}-t{len(self.turns)}"
        self.turns.append(TurnInput(turn_id, role, text, _iso(self.now), f"{self.case_id}-s", speaker))

    def say(self, text: str, after_days: float = 0.0, speaker: str | None = None) -> date:
        self.now += timedelta(days=after_days, minutes=self.rng.randint(1, 9))
        if self.filler and self.rng.random() < 0.3:
            self._add("user", self.rng.choice(_USER_FILLER))
            self.now += timedelta(minutes=1)
        self._add("user", text, speaker)
        day = self.now.date()
        if self.filler and self.rng.random() < 0.5:
            self.now += timedelta(minutes=1)
            self._add("assistant", self.rng.choice(_ASSISTANT))
        return day


def _start(rng: random.Random) -> datetime:
    return datetime(2026, 1, 5, 8, 0, tzinfo=timezone.utc) + timedelta(
        days=rng.randint(0, 300), minutes=rng.randint(0, 12 * 60)
    )


def _pick(rng: random.Random, pool: tuple[str, ...] | list[str], n: int) -> list[str]:
    return rng.sample(list(pool), n)


def _article(word: str) -> str:
    return "an" if word[0].lower() in "aeiou" else "a"


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


# ---- extraction cases ------------------------------------------------------------------------------------
# (message, expected facts) templates; fields are filled from the vocabulary above.

_EXTRACTION_TEMPLATES: dict[str, tuple[tuple[str, tuple[str, ...]], ...]] = _TEMPLATES["extraction_templates"]
# assistant turns state things too; none of it is the user's
_ASSISTANT_STATEMENTS = (
    "I live in the cloud, so I don't have a home city.",
    "I love helping with recipes!",
    "I'm a large language model trained to be helpful.",
    "My favourite colour? I don't really have one, but blue is popular.",
    "You mentioned you live in {city}; that's a lovely place.",
    "I recommend visiting {city} in spring.",
)


def _fields(rng: random.Random) -> dict[str, str]:
    job = rng.choice(JOBS)
    (obj, _), (obj2, _) = rng.sample(OBJECTS, 2)
    species, species2 = rng.sample(SPECIES, 2)
    city, city2 = rng.sample(CITIES, 2)
    food = rng.choice(FOODS)
    name = rng.choice(NAMES)
    return {
        "city": city,
        "city2": city2,
        "a_job": f"{_article(job)} {job}",
        "company": rng.choice(COMPANIES),
        "species": species,
        "species2": species2,
        "pet": rng.choice(PET_NAMES),
        "obj": obj,
        "obj2": obj2,
        "colour": rng.choice(COLOURS),
        "food": food,
        "food_cap": food.capitalize(),
        "name": name,
        "age": str(rng.randint(19, 78)),
        "email": f"{name.lower()}.{rng.randint(10, 99)}@example.com",
        "phone": f"+351 91{rng.randint(0, 9)} {rng.randint(100, 999)} {rng.randint(100, 999)}",
        "rel": rng.choice(("sister", "brother", "mom", "dad", "aunt", "grandmother")),
    }


def _date_case(rng: random.Random, day: date) -> tuple[str, str, str]:
    """(message, expected fact, the absolute phrase it must contain) for one relative date."""
    event = rng.choice(EVENTS_PAST)
    plan = rng.choice(PLANS)
    weekday = rng.randrange(7)
    wname = _WEEKDAYS[weekday]
    n = rng.randint(2, 5)
    words = {2: "two", 3: "three", 4: "four", 5: "five"}
    last_week = f"in the week of {_monday(day) - timedelta(days=7)}"
    choices = (
        (f"Yesterday I {event}.", f"On {day - timedelta(days=1)} I {event}", f"on {day - timedelta(days=1)}"),
        (f"I {event} yesterday.", f"I {event} on {day - timedelta(days=1)}", f"on {day - timedelta(days=1)}"),
        (f"I {event} last week.", f"I {event} {last_week}", last_week),
        (f"Last month I {event}.", f"In {_month_name(day, 1)} I {event}", f"in {_month_name(day, 1)}"),
        (
            f"I {event} {words[n]} days ago.",
            f"I {event} on {day - timedelta(days=n)}",
            f"on {day - timedelta(days=n)}",
        ),
        (
            f"I {event} {n} days ago.",
            f"I {event} on {day - timedelta(days=n)}",
            f"on {day - timedelta(days=n)}",
        ),
        (
            f"Last {wname} I {event}.",
            f"On {_last_weekday(day, weekday)} I {event}",
            f"on {_last_weekday(day, weekday)}",
        ),
        (
            f"On {wname} I {event}.",
            f"On {_last_weekday(day, weekday)} I {event}",
            f"on {_last_weekday(day, weekday)}",
        ),
        (f"This morning I {event}.", f"On the morning of {day} I {event}", f"on the morning of {day}"),
        (
            f"Tomorrow I'm going to {plan}.",
            f"On {day + timedelta(days=1)} I'm going to {plan}",
            f"on {day + timedelta(days=1)}",
        ),
        (
            f"I'm going to {plan} next week.",
            f"I'm going to {plan} in the week of {_monday(day) + timedelta(days=7)}",
            f"in the week of {_monday(day) + timedelta(days=7)}",
        ),
        (f"Last year I {event}.", f"In {day.year - 1} I {event}", f"in {day.year - 1}"),
        (
            f"I'm going to {plan} tonight.",
            f"I'm going to {plan} on the night of {day}",
            f"on the night of {day}",
        ),
        (
            f"I {event} a week ago.",
            f"I {event} in the week of {_monday(day - timedelta(days=7))}",
            f"in the week of {_monday(day - timedelta(days=7))}",
        ),
    )
    return rng.choice(choices)


def extraction_cases(
    seed: int = SEED, per_template: int = 2, num_date_cases: int = 60
) -> list[ExtractionCase]:
    """Every template `per_template` times with fresh fillers, `num_date_cases` relative-date cases, a few
    multi-party turns (speaker set) and assistant turns; 300+ cases at the defaults, in a fixed order."""
    rng = random.Random(seed + 1)
    cases: list[ExtractionCase] = []

    def turn(case_id: str, text: str, role: str = "user", speaker: str | None = None) -> TurnInput:
        moment = _start(rng)
        return TurnInput(f"{case_id}-t0", role, text, _iso(moment), f"{case_id}-s", speaker)

    for category, templates in _EXTRACTION_TEMPLATES.items():
        for t, (message, expected) in enumerate(templates):
            for k in range(per_template):
                fields = _fields(rng)
                case_id = f"ext-{category}-{t}-{k}"
                cases.append(
                    ExtractionCase(
                        case_id,
                        category,
                        (turn(case_id, message.format(**fields)),),
                        tuple(e.format(**fields) for e in expected),
                    )
                )
    for k, message in enumerate(_ASSISTANT_STATEMENTS * per_template):
        case_id = f"ext-nothing_assistant-{k}"
        text = message.format(**_fields(rng))
        cases.append(ExtractionCase(case_id, "nothing_assistant", (turn(case_id, text, "assistant"),), ()))
    for k in range(num_date_cases):
        case_id = f"ext-dates-{k}"
        t = turn(case_id, "")
        day = datetime.fromisoformat(t.chat_time.replace("Z", "+00:00")).date()
        message, expected, phrase = _date_case(rng, day)
        t = TurnInput(t.id, "user", message, t.chat_time, t.session_id)
        cases.append(ExtractionCase(case_id, "dates", (t,), (expected,), (phrase,)))
    speaker_lines = (
        ("I finally went bouldering at the new gym.", ("I finally went bouldering at the new gym",)),
        ("My puppy chewed my running shoes again!", ("My puppy chewed my running shoes again",)),
        ("Nice! Did you like it?", ()),
        ("I'm taking a ceramics class on Thursdays.", ("I'm taking a ceramics class on Thursdays",)),
        ("Haha, that's so true.", ()),
    )
    for k, (line, expected) in enumerate(speaker_lines * per_template):
        case_id = f"ext-speaker-{k}"
        cases.append(
            ExtractionCase(case_id, "speaker", (turn(case_id, line, speaker=rng.choice(NAMES)),), expected)
        )
    return cases
