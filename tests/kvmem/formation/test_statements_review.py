"""A review's findings on the rules' readings of statements told around other words (clauses, slots, dates,
change_guard at 9c5c061): each case read a slot, a split or a date wrongly there and states the behaviour kept
since. The sentences are the review's own, written apart from the sealed held-out sets."""

from __future__ import annotations

import pytest

from kvmem.formation.change_guard import blocker
from kvmem.formation.dates import resolve_dates
from tests.kvmem.formation.test_state_changes import triples

NOW = "2026-05-01T10:00:00+00:00"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("We called it a day at 5 and went to the pub.", []),
        ("I called it a day early because of the rain.", []),
        ("We called it quits on the renovation and hired a builder.", []),
        ("My brother and I are done!", []),
        ("Mum and I are finished.", []),
        ("Amazon ghosted me after the final interview.", []),
        ("Sarah ghosted me, so much for being friends.", []),
        ("My wife has left me in charge of the kids this weekend.", []),
        ("The missus has left me to do the washing up.", []),
        ("Jake proposed last night and she said yes!", []),
        ("Dave proposed in the meeting that we move the deadline.", []),
        ("Tom proposed and Anna said yes, so happy for them!", []),
        ("I hung up my scrubs and went straight to bed.", []),
        ("I hung up my wet gloves to dry by the fire.", []),
        ("I put in for my retirement.", []),
        ("I've hung up my boots for good.", [("user|job", "retired")]),
        ("Lockdown made me a baker.", []),
        ("Netflix made me a cook.", []),
        ("They made me the designated driver again.", []),
        ("My kids have made me a part-time taxi driver.", []),
        ("The baby has promoted me to grandad.", []),
        ("They've promoted me to godmother.", []),
        ("My neighbour hired me as a dog walker for the weekend.", []),
        ("The nursery took me on as a volunteer.", []),
        ("My manager promoted me to head chef.", [("user|job", "head chef")]),
        ("I'm the new Mrs Patel!", []),
        ("I'm the new owner of a puppy.", []),
        ("I'm the new kid at work.", []),
        ("I'm the new manager at the Co-op.", [("user|job", "manager")]),
        ("I found a new place in Camden that does great pizza.", []),
        ("We found a new apartment in Paris for our holiday.", []),
        ("We moved into a cottage in Cornwall for the summer.", []),
        ("I moved into the new studio in Hackney for my pottery.", []),
        ("When the divorce is final and I'm single again, I'm moving to Spain.", []),
        ("As soon as it's signed and I'm married, we can relax.", []),
        ("Once it's sold and I've moved to Leeds I'll feel better.", []),
        ("Hopefully by June the flat's sold and we've moved to Bristol.", []),
        (
            "I moved to Leeds after the wedding and I started a new job at Tesco.",
            [("user|home_city", "leeds"), ("user|employer", "tesco")],
        ),
        (
            "I quit Tesco after Easter and I work at Aldi now.",
            [("user|employer", "not:tesco"), ("user|employer", "aldi")],
        ),
        (
            "I moved to Bristol after Uni and I work at Airbus now.",
            [("user|home_city", "bristol"), ("user|employer", "airbus")],
        ),
        ("I've loved cooking, since I retired from the army at 19.", []),
        ("Everything's changed, since I got divorced twenty years ago.", []),
        ("My dad was just like that.", []),
        ("I want a kitchen just like that.", []),
        ("Married couples get a tax break and I'm single.", [("user|relationship", "single")]),
        ("Retired teachers are the best and I should know.", []),
    ],
)
def test_only_what_the_user_states_sets_a_slot(text: str, expected: list) -> None:
    assert [(slot, value) for _, slot, value in triples(text) if slot] == expected


@pytest.mark.parametrize(
    ("text", "resolved"),
    [
        ("I moved to Leeds last month of course.", "I moved to Leeds in April 2026 of course."),
        ("I quit last week of my own accord.", "I quit in the week of 2026-04-20 of my own accord."),
        (
            "I started my new job this week of all weeks.",
            "I started my new job in the week of 2026-04-27 of all weeks.",
        ),
        ("I handed in my notice last week of term.", "I handed in my notice last week of term."),
    ],
)
def test_a_date_before_of_is_left_only_before_a_span(text: str, resolved: str) -> None:
    assert resolve_dates(text, NOW).text == resolved


@pytest.mark.parametrize(
    "clause",
    [
        "My supervisor promoted me to senior nurse",
        "My manager took me on as a trainee",
        "My mother-in-law hired me",
    ],
)
def test_a_job_given_to_the_user_is_the_users_news(clause: str) -> None:
    assert blocker(clause) != "another person"


def test_another_persons_retirement_is_theirs() -> None:
    assert blocker("My old sergeant finally retired last week") == "another person"
