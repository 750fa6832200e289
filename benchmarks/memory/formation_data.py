"""Synthetic, labelled chat turns for evaluating memory formation: extraction cases (turns -> the atomic facts
they state) and supersession cases (a short history of user turns -> which facts are current and which were
superseded at the end), each built from templates with varied wording and a fixed seed. This module holds what
every set shares: the case types, the vocabulary, the calendar, how a case's turns are built and a template's
fields filled; the cases themselves are built in formation_extraction.py, formation_supersession.py (with the
distractors of formation_distractors.py) and formation_heldout.py.

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
_TEMPLATES = _tuples(
    json.loads((Path(__file__).resolve().parents[1] / "data" / "formation_templates.json").read_text())
)
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


# ---- template fields -------------------------------------------------------------------------------------


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
