"""kvmem.formation.dates: exact rewrites and event dates against a fixed clock (Thursday 2026-11-26)."""

from __future__ import annotations

from datetime import date

import pytest

from kvmem.formation.dates import iso_time, parse_chat_time, resolve_dates

NOW = "2026-11-26T14:41:09.000000Z"  # a Thursday


@pytest.mark.parametrize(
    ("text", "rewritten", "event"),
    [
        ("Yesterday I went to the dentist", "On 2026-11-25 I went to the dentist", date(2026, 11, 25)),
        ("I moved here last month", "I moved here in October 2026", date(2026, 10, 1)),
        ("I was sick last week", "I was sick in the week of 2026-11-16", date(2026, 11, 16)),
        ("we start next week", "we start in the week of 2026-11-30", date(2026, 11, 30)),
        ("I quit smoking last year", "I quit smoking in 2025", date(2025, 1, 1)),
        ("I'm flying out tomorrow", "I'm flying out on 2026-11-27", date(2026, 11, 27)),
        ("today I ran 5k", "on 2026-11-26 I ran 5k", date(2026, 11, 26)),
        ("we celebrate tonight", "we celebrate on the night of 2026-11-26", date(2026, 11, 26)),
        ("this morning I baked bread", "on the morning of 2026-11-26 I baked bread", date(2026, 11, 26)),
        ("I cooked this evening", "I cooked on the evening of 2026-11-26", date(2026, 11, 26)),
        ("last night was fun", "on the night of 2026-11-25 was fun", date(2026, 11, 25)),
        ("I met her 3 days ago", "I met her on 2026-11-23", date(2026, 11, 23)),
        ("I met her three days ago", "I met her on 2026-11-23", date(2026, 11, 23)),
        ("I started two weeks ago", "I started in the week of 2026-11-09", date(2026, 11, 9)),
        ("it arrives in 2 days", "it arrives on 2026-11-28", date(2026, 11, 28)),
        ("next month I move", "in December 2026 I move", date(2026, 12, 1)),
        ("I saw him last Monday", "I saw him on 2026-11-23", date(2026, 11, 23)),
        ("I saw him last Thursday", "I saw him on 2026-11-19", date(2026, 11, 19)),
        ("see you this Friday", "see you on 2026-11-27", date(2026, 11, 27)),
        ("next Monday is my birthday", "on 2026-11-30 is my birthday", date(2026, 11, 30)),
        ("On Friday I went hiking", "On 2026-11-20 I went hiking", date(2026, 11, 20)),  # past: the last one
        ("I have a meeting on Friday", "I have a meeting on 2026-11-27", date(2026, 11, 27)),  # else next
        ("I have a meeting on Thursday", "I have a meeting on 2026-12-03", date(2026, 12, 3)),
        ("since last week I cough", "since the week of 2026-11-16 I cough", date(2026, 11, 16)),
        ("the day before yesterday", "on 2026-11-24", date(2026, 11, 24)),
        ("last weekend we hiked", "on the weekend of 2026-11-21 we hiked", date(2026, 11, 21)),
    ],
)
def test_rewrites_and_event_date(text: str, rewritten: str, event: date) -> None:
    got = resolve_dates(text, NOW)
    assert got.text == rewritten
    assert got.event_date == event


@pytest.mark.parametrize(
    "text",
    [
        "I go swimming on Mondays",
        "last week's meeting ran long",
        "We're going to Japan in May",
        "I love today's",
        "Haven't touched a cigarette in a month",  # a span up to now, not a date ahead
        "I've not had a drink in two weeks",
        "removalists are booked for the last week of February",  # a part of a named month, not last week
        "The next week was a blur",
        "last week of term is always chaos",
        "It was the last Friday of the month",
    ],
)
def test_habits_possessives_and_bare_months_are_left_alone(text: str) -> None:
    got = resolve_dates(text, NOW)
    assert got.text == text and got.event_date is None and got.dates == ()


def test_every_phrase_is_listed_in_order() -> None:
    got = resolve_dates("Yesterday I booked it and next month I fly", NOW)
    assert got.text == "On 2026-11-25 I booked it and in December 2026 I fly"
    assert [(d.phrase, d.replacement, d.start, d.end) for d in got.dates] == [
        ("Yesterday", "On 2026-11-25", date(2026, 11, 25), date(2026, 11, 25)),
        ("next month", "in December 2026", date(2026, 12, 1), date(2026, 12, 31)),
    ]


def test_the_clock_is_the_turns_utc_day() -> None:
    # 23:30 at UTC-5 is already the next day in UTC
    assert resolve_dates("yesterday", "2026-11-26T23:30:00-05:00").text == "on 2026-11-26"
    assert resolve_dates("yesterday", "2026-01-01").text == "on 2025-12-31"


def test_times_round_trip_in_the_log_format() -> None:
    assert iso_time(parse_chat_time(NOW)) == NOW
    assert iso_time(date(2026, 11, 25)) == "2026-11-25T00:00:00.000000Z"
    with pytest.raises(ValueError, match="chat_time: not an ISO 8601 time: 'soon'"):
        parse_chat_time("soon")


def test_in_n_weeks_is_a_date_ahead_unless_its_clause_is_negated() -> None:
    assert resolve_dates("No, we move in two weeks", NOW).dates != ()  # the negation is another clause's
    assert resolve_dates("I didn't get the job, but I start at Aldi in two weeks", NOW).dates != ()
