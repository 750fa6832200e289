"""States held and ended in the forms people use (issue 45 item 3, after the eleventh sealed set was read): a home,
a job or a partner told as held ("We rent a semi in Derby", "I run a bakery", "I've been married to Ann for years"),
so that a later change has a slot to retire; endings told without the words the earlier rules knew ("got the sack",
"the wedding's off"); statements after a leading phrase with no comma; and a day's passing events, which are not
kept. Development examples written apart from the sealed sets."""

from __future__ import annotations

import pytest

from kvmem.formation.change_guard import blocker, other_area
from kvmem.formation.rules import slot_of
from tests.kvmem.formation.test_state_changes import superseded, triples

NOW = "2026-05-01T10:00:00+00:00"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # a home held
        ("We rent a semi in Derby.", ("user|home_city", "derby")),
        ("I've got a little flat in Bath.", ("user|home_city", "bath")),
        ("We're in a maisonette in Hove.", ("user|home_city", "hove")),
        ("I'm living with my aunt in Preston for now.", ("user|home_city", "preston")),
        ("We've got a holiday cottage in Devon.", None),
        ("I'm still living in the Leeds house.", ("user|home_city", "leeds")),
        ("We're in Dundee now, so the commute is shorter.", ("user|home_city", "dundee")),
        ("We completed on a bungalow in Ripon.", ("user|home_city", "ripon")),
        ("I came back home to Cork.", ("user|home_city", "cork")),
        # a job held
        ("I'm a ticket inspector on the trains.", ("user|job", "ticket inspector")),
        ("I am data engineer at a startup in Porto.", ("user|job", "data engineer")),
        ("I'm the deputy head of a primary school.", None),
        ("I'm the head chef at a hotel.", ("user|job", "chef")),
        ("I run a small bakery in Frome.", ("user|job", "runs a small bakery")),
        ("I run a book club.", None),
        ("I work behind the bar at the Crown.", ("user|employer", "crown")),
        ("I've gone into insurance.", ("user|job", "insurance")),
        ("I've gone into labour.", None),
        (
            "Started at the county library's archive office.",
            ("user|employer", "county library's archive office"),
        ),
        ("I started at the office at 8.", None),
        # a job ended
        ("I got the boot on Friday.", ("user|job", "none")),
        ("I'm done at the bakery for good.", ("user|job", "none")),
        ("I'm done at work, off home now.", None),
        ("I quit smoking.", ("user|likes:smoking", "no")),
        (
            "I quit the sandwich place, the hours were awful.",
            None,
        ),  # a job, not a taste: left to the learned readings
        ("Gave up the bar job, been skint since.", ("user|job", "none")),
        # a partner held or gone
        ("I've been married to Ann for thirty years.", ("user|relationship", "married")),
        ("Been with Theo since uni.", ("user|relationship", "in a relationship")),
        ("Rosa's left me.", ("user|relationship", "single")),
        ("it's over with dan.", ("user|relationship", "single")),
        ("It's over with work for today.", None),
        ("The divorce came through on Tuesday.", ("user|relationship", "divorced")),
        ("We called the wedding off.", ("user|relationship", "single")),
        ("The engagement's off.", ("user|relationship", "single")),
        ("Jo and I are done.", None),  # a brother or a business partner as well
        # tastes
        ("I've never liked olives.", ("user|likes:olives", "no")),
        ("I love running, the longer the better.", ("user|likes:running", "yes")),
        ("I love running, swimming and cycling.", None),  # a list: no one slot
        ("I've gone right off crisps, can't face them.", ("user|likes:crisps", "no")),
        ("I've fallen for bouldering.", ("user|likes:bouldering", "yes")),
        ("I've fallen for Sam.", None),
        ("I'm a big rugby fan.", ("user|likes:rugby", "yes")),
        ("No sugar for me.", ("user|likes:sugar", "no")),
        ("I've properly got into baking.", ("user|likes:baking", "yes")),
        ("Binned the cigarettes last week.", ("user|likes:cigarettes", "no")),
    ],
)
def test_held_and_ended_states_set_these_slots(text: str, expected: tuple[str, str] | None) -> None:
    assert slot_of(text) == expected


@pytest.mark.parametrize(
    ("earlier", "later", "retired"),
    [
        ("We rent a semi in Derby.", "We've moved to Leicester.", "We rent a semi in Derby"),
        (
            "I'm a ticket inspector on the trains.",
            "I retired on Friday.",
            "I'm a ticket inspector on the trains",
        ),
        ("I've been married to Ann for thirty years.", "The divorce came through.", None),
        ("I'm engaged to Kit.", "We called the wedding off.", "I'm engaged to Kit"),
        ("I'm seeing someone.", "It's over with mo.", "I'm seeing someone"),
        ("I run a small bakery in Frome.", "I got the boot.", None),
    ],
)
def test_a_held_state_is_retired_by_its_change(earlier: str, later: str, retired: str | None) -> None:
    got = superseded(earlier, later)
    assert got == ([retired] if retired else [earlier.rstrip(".")])


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "After the knee op I've given up squash.",
            [("After the knee op I've given up squash", "user|likes:squash", "no")],
        ),
        (
            "After the third bad review I finally resigned.",
            [("After the third bad review I finally resigned", "user|job", "none")],
        ),
        ("Since the move I've been so much happier.", []),  # "since": a state as it is, not kept
        ("With my brother I went to Leeds.", [("With my brother I went to Leeds", None, None)]),
        (
            "Every Sunday I play golf at the club.",
            [("Every Sunday I play golf at the club", "user|likes:golf", "yes")],
        ),
        (
            "From this week I am in early retirement.",
            [("From the week of 2026-04-27 I am in early retirement", "user|job", "retired")],
        ),
        ("Twenty years in the job done, retired in March.", [("Retired in March", "user|job", "retired")]),
        ("Resigned. No regrets.", [("Resigned", "user|job", "none")]),
        ("The kids loved it, went home after.", []),
        (
            "No sugar for me, I'm cutting down.",
            [("No sugar for me", "user|likes:sugar", "no"), ("I'm cutting down", None, None)],
        ),
        ("No, I live in York.", [("I live in York", "user|home_city", "york")]),
    ],
)
def test_statements_after_a_leading_phrase(text: str, expected: list) -> None:
    got = triples(text, NOW)
    assert [(t, s, v) for t, s, v in got] == expected


@pytest.mark.parametrize(
    ("text", "kept"),
    [
        ("Saw a fox in the garden this morning.", False),
        ("Had a customer today who paid in coppers.", False),
        ("I swear.", False),
        ("I passed my driving test today!", True),
        ("Visited my gran this afternoon.", True),
        ("Got the keys this morning.", True),
        ("My divorce came through this morning.", True),  # a slot
        ("I'm going to the dentist today.", True),  # not past: a plan
        ("I went to Rome last year.", True),  # not the day it is said on
    ],
)
def test_a_days_passing_event_is_not_kept(text: str, kept: bool) -> None:
    assert bool(triples(text, NOW)) == kept


def test_another_area_reads_every_part_of_a_compound_memory() -> None:
    # the age is the memory's first slot, but what follows "and" is not about the age: a job's change may retire it
    assert not other_area("I've retired", "I'm 64 and still doing the payroll for two shops.")
    assert other_area("I've retired", "I live in Leeds.")
    assert other_area("I've retired", "I live in Leeds and I love my garden.")


@pytest.mark.parametrize(
    ("clause", "expected"),
    [
        ("I've been going to pilates since March", None),  # "going to": not a plan after "been"
        ("I'm going to quit", "plan"),
        ("Binned the vape in March", None),
        ("Shifted down to Exeter", None),
        ("I went home to Sligo", None),
        ("I got the sack", None),
        ("We called the whole thing off", None),
    ],
)
def test_the_guard_reads_these_changes(clause: str, expected: str | None) -> None:
    assert blocker(clause) == expected
