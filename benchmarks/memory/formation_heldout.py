"""Held-out sets of labelled chat turns for memory formation: phrasings written after the rule extractor was
frozen, in wording its patterns were not written from, and never used to change it. Built from the templates
of data/formation_templates.json with the vocabulary and calendar of benchmarks/memory/formation_data.py (the
development sets), a fixed seed each.
"""

from __future__ import annotations

import random
from datetime import date, timedelta

from benchmarks.memory.formation_data import (
    _TEMPLATES,
    COLOURS,
    COMPANIES,
    FOODS,
    JOBS,
    OBJECTS,
    PET_NAMES,
    SEED,
    ExtractionCase,
    SupersessionCase,
    _article,
    _fields,
    _History,
    _iso,
    _last_weekday,
    _monday,
    _month_name,
    _start,
)
from kvmem.formation.types import TurnInput

# ---- held-out phrasings --------------------------------------------------------------------------------------
# Written after the rule extractor was frozen, in wording its patterns were not written from, and never
# used to change it: the "heldout" figures estimate how the rules do on phrasings nobody tuned them on.
# Each entry: (message, expected fact or None when the message states nothing); "{...}" date fields are
# filled for the day the message is said (see `_date_fields`).


def _date_fields(day: date) -> dict[str, str]:
    return {
        "yesterday": f"on {day - timedelta(days=1)}",
        "last_week": f"in the week of {_monday(day) - timedelta(days=7)}",
        "last_month": f"in {_month_name(day, 1)}",
        "last_year": f"in {day.year - 1}",
        "last_saturday": f"on {_last_weekday(day, 5)}",
        "last_weekend": f"on the weekend of {_monday(day) - timedelta(days=2)}",
        "next_week": f"in the week of {_monday(day) + timedelta(days=7)}",
        "two_days_ago": f"on {day - timedelta(days=2)}",
        "this_week": f"in the week of {_monday(day)}",
        "this_month": f"in {_month_name(day, 0)}",
    }


Said = tuple[str, "str | None"]
# category: (distractor, first messages, second messages); "{a}"/"{b}" etc. from _heldout_fields
_HELDOUT_SUPERSESSION: dict[str, tuple[bool, tuple[Said, ...], tuple[Said, ...]]] = _TEMPLATES[
    "heldout_supersession"
]


_PAIRED = {"correction", "favourite"}


def _heldout_fields(rng: random.Random) -> dict[str, str]:
    base = _fields(rng)
    j2 = rng.choice([j for j in JOBS if f" {j}" not in base["a_job"]])
    (o2, _) = rng.choice([o for o in OBJECTS if o[0] != base["obj"]])
    colour2 = rng.choice([c for c in COLOURS if c != base["colour"]])
    food2 = rng.choice([f for f in FOODS if f != base["food"]])
    return {
        **base,
        "a": base["city"],
        "b": base["city2"],
        "a_job2": f"{_article(j2)} {j2}",
        "company2": rng.choice([c for c in COMPANIES if c != base["company"]]),
        "obj_cap": base["obj"].capitalize(),
        "obj2": o2,
        "pet2": rng.choice([p for p in PET_NAMES if p != base["pet"]]),
        "colour_cap": base["colour"].capitalize(),
        "colour2": colour2,
        "food2": food2,
        "age2": str(int(base["age"]) + 9),
        "last_month_raw": "last month",
        "last_week_raw": "last week",
    }


def _supersession_set(table, paired, rng: random.Random, prefix: str, per_category: int, fields_of):
    """`per_category` cases of each category of `table`: first statement then, some days later, the second,
    which supersedes the first except in distractor categories. In `paired` categories the i-th second
    message corrects or changes the i-th first one; a second fact may hold two atomic facts ("||")."""
    cases = []
    for category, (distractor, firsts, seconds) in table.items():
        for k in range(per_category):
            case_id = f"{prefix}-{category}-{k}"
            h = _History(rng, case_id, _start(rng))
            fields = fields_of(rng)
            i = rng.randrange(len(firsts))
            first, first_fact = firsts[i]
            second, second_fact = seconds[i] if category in paired else rng.choice(seconds)
            h.say(first.format(**fields))
            day = h.say(
                second.format(**fields),
                after_days=rng.randint(1, 200) if distractor else rng.randint(20, 200),
            )
            fields.update(_date_fields(day))
            new = second_fact.format(**fields).split("||") if second_fact else []
            old = [first_fact.format(**fields)] if first_fact else []
            current, superseded = (old + new, []) if distractor else (new, old)
            cases.append(
                SupersessionCase(
                    case_id, category, distractor, tuple(h.turns), tuple(current), tuple(superseded)
                )
            )
    return cases


def heldout_supersession_cases(seed: int = SEED, per_category: int = 12) -> list[SupersessionCase]:
    """Held-out phrasings (see above): `per_category` cases of each of 14 categories (`_supersession_set`)."""
    rng = random.Random(seed + 2)
    return _supersession_set(_HELDOUT_SUPERSESSION, _PAIRED, rng, "held", per_category, _heldout_fields)


_HELDOUT_EXTRACTION: dict[str, tuple[Said, ...]] = _TEMPLATES["heldout_extraction"]
_RAW_DATES = {
    "last_week_raw": "last week",
    "two_days_ago_raw": "a couple of days ago",
    "last_weekend_raw": "last weekend",
    "yesterday_raw": "yesterday",
    "next_week_raw": "next week",
}


def heldout_extraction_cases(seed: int = SEED, per_template: int = 3) -> list[ExtractionCase]:
    """Held-out phrasings (see above), each template `per_template` times: 123 cases at the default."""
    rng = random.Random(seed + 3)
    cases = []
    for category, templates in _HELDOUT_EXTRACTION.items():
        for t, (message, fact) in enumerate(templates):
            for k in range(per_template):
                case_id = f"held-ext-{category}-{t}-{k}"
                moment = _start(rng)
                fields = {**_heldout_fields(rng), **_RAW_DATES, **_date_fields(moment.date())}
                turn = TurnInput(
                    f"{case_id}-t0", "user", message.format(**fields), _iso(moment), f"{case_id}-s"
                )
                phrases = tuple(
                    _date_fields(moment.date())[key[:-4]] for key in _RAW_DATES if "{" + key + "}" in message
                )
                expected = (fact.format(**fields),) if fact else ()
                cases.append(ExtractionCase(case_id, f"heldout_{category}", (turn,), expected, phrases))
    return cases


# ---- held-out phrasings, second set ----------------------------------------------------------------------------
# The first held-out set above was used to improve the rules after its first run (its figures at that time
# are in benchmarks/results/cpu/formation_heldout_v1.json), so it is no longer held out. This second set was
# written after that round, in wording the rules were again not written from, and never used to change them.

_HELDOUT2_SUPERSESSION: dict[str, tuple[bool, tuple[Said, ...], tuple[Said, ...]]] = _TEMPLATES[
    "heldout2_supersession"
]
_PAIRED2 = {"relationship", "correction", "diet", "favourite"}
_RAW_DATES2 = {
    "last_week_raw": "last week",
    "last_month_raw": "last month",
    "last_year_raw": "last year",
    "last_weekend_raw": "last weekend",
    "yesterday_raw": "yesterday",
    "next_week_raw": "next week",
    "three_days_ago_raw": "three days ago",
}


def _heldout2_fields(rng: random.Random) -> dict[str, str]:
    fields = {**_heldout_fields(rng), **_RAW_DATES2}
    fields["company2_cap"] = fields["company2"][0].upper() + fields["company2"][1:]
    fields["colour2_cap"] = fields["colour2"].capitalize()
    return fields


def heldout2_supersession_cases(seed: int = SEED, per_category: int = 12) -> list[SupersessionCase]:
    """The second held-out set: `per_category` cases of each of 14 categories, built like the first."""
    rng = random.Random(seed + 4)
    return _supersession_set(_HELDOUT2_SUPERSESSION, _PAIRED2, rng, "held2", per_category, _heldout2_fields)


_HELDOUT2_EXTRACTION: dict[str, tuple[tuple[str, tuple[str, ...]], ...]] = _TEMPLATES["heldout2_extraction"]


def heldout2_extraction_cases(seed: int = SEED, per_template: int = 3) -> list[ExtractionCase]:
    """The second held-out extraction set, each template `per_template` times: 108 cases at the default."""
    rng = random.Random(seed + 5)
    cases = []
    for category, templates in _HELDOUT2_EXTRACTION.items():
        for t, (message, facts) in enumerate(templates):
            for k in range(per_template):
                case_id = f"held2-ext-{category}-{t}-{k}"
                moment = _start(rng)
                day = moment.date()
                dates = {
                    **_date_fields(day),
                    "three_days_ago": f"on {day - timedelta(days=3)}",
                    "next_friday": f"on {day + timedelta(days=(4 - day.weekday()) % 7 or 7)}",
                }
                fields = {**_heldout_fields(rng), **_RAW_DATES2, **dates}
                turn = TurnInput(
                    f"{case_id}-t0", "user", message.format(**fields), _iso(moment), f"{case_id}-s"
                )
                phrases = tuple(dates[key[:-4]] for key in _RAW_DATES2 if "{" + key + "}" in message)
                if "on Friday" in message:
                    phrases = (dates["next_friday"],)
                expected = tuple(f.format(**fields) for f in facts)
                cases.append(ExtractionCase(case_id, f"heldout2_{category}", (turn,), expected, phrases))
    return cases
