"""The extraction cases: single turns and the atomic facts they state (templates with fresh fillers, relative
dates resolved by formation_data.py's own calendar, assistant turns that state nothing of the user, turns of
several speakers).

Knows nothing of any extractor.
"""

from __future__ import annotations

import random
from datetime import date, datetime, timedelta

from benchmarks.memory.formation_data import (
    _TEMPLATES,
    _WEEKDAYS,
    EVENTS_PAST,
    NAMES,
    PLANS,
    SEED,
    ExtractionCase,
    _fields,
    _iso,
    _last_weekday,
    _monday,
    _month_name,
    _start,
)
from kvmem.formation.types import TurnInput

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
