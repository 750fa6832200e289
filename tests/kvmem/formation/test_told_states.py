"""Changes of state told in the forms the twelfth sealed set's misses showed (issue 45 item 3, read after it was
scored once): a statement behind a frame that only announces it ("Please note that I have relocated to Lausanne",
"I am pleased to report that ..."), a move "packed up and gone" to, "I stay in Durban" as where one lives, a post
taken "as a quality inspector", "I've been unemployed since March", "X and me are not together anymore", chat's "n"
for "and", "No more sugar in my tea", "Gone veggie", "Cut the sugar out"; the guard's words of change ("commenced",
"shifted up to", "taken me on as") and its restatement word read only before a concessive; a habit held now as a
taste; and "on Sunday evenings" left alone as a habit, not resolved to one evening. And what a review of the first
version (53b17db) found read wrongly, kept here as it is read since: a hotel, a game or a weekday stay as a home, a
switch of phone network "shifted to", "packed up and headed to Spain for the summer", unemployed "before", a wish or
a role-play behind a frame, "finished at the hospital" after a shift, "took me on a trip", "began life as a
chemist", a chore done every day, "Coffee and me"; and what a second review (of 3be3cdd) found: a trip told "I'm in X
now, ...", a habit that goes with a taste ("I do parkrun now" and "I love running"), "No more coffee for me today",
"Gone part-time", "Cut my Netflix for a month". Development examples written apart from the sealed sets."""

from __future__ import annotations

import pytest

from kvmem.formation.change_guard import (
    blocker,
    ends_partnership,
    names_partner,
    partner_named_in_ending,
)
from kvmem.formation.rules import slot_of
from kvmem.formation.tastes_told import (
    shares_a_word,
    tells_habit_now,
    tells_new_habit,
    tells_not_mine,
    tells_taste,
)
from tests.kvmem.formation.test_state_changes import superseded, triples

NOW = "2026-05-01T10:00:00+00:00"  # a Friday


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("I stay in Durban, near the beachfront.", ("user|home_city", "durban")),
        ("I stay in hotels when I travel.", None),
        ("I stay in Rome for a week.", None),
        ("I stay in on Fridays.", None),
        ("I stay in Travelodge.", None),
        ("I stay in London, Monday to Friday.", None),
        ("I stay in Glasgow, at my mum's, till the flat's ready.", None),
        ("We stay in Center Parcs.", None),
        ("I stay in Florida, in the winter months.", None),
        ("We've packed up and gone to Joburg now.", ("user|home_city", "joburg")),
        ("I've shifted to Python.", None),  # "shifted" is a word of change only, not a home
        ("Packed up and headed to Spain for the summer.", None),
        ("I've packed up and gone to Mum's.", None),
        ("Got a proper flat in Lincoln now.", ("user|home_city", "lincoln")),
        ("Started at the Royal Mint on Monday as a quality inspector.", ("user|job", "quality inspector")),
        (
            "I have accepted, and commenced, a post as a junior actuary with a pensions consultancy.",
            ("user|job", "junior actuary"),
        ),
        ("I joined the choir as a tenor.", None),
        ("I began life as a chemist.", None),
        ("I started uni as a mature student.", None),
        ("I joined the cast as a dancer.", None),
        ("I started at the firm as a trainee back in 1998.", None),
        ("I started at the club as a sub.", None),
        ("Joined the gym as a member.", None),
        ("I'm in Hospital now.", None),
        ("I'm in the Army now.", None),
        ("We're in Edinburgh now, Leith to be exact.", None),  # said last only: a review found trips told so
        ("I have been unemployed since March.", ("user|job", "none")),
        ("I've been unemployed before.", None),
        ("I've been out of work for two weeks with flu.", None),
        ("Coffee and me are not together anymore.", None),
        ("Netflix and I broke up.", None),
        ("Joost and me are not together anymore.", ("user|relationship", "single")),
    ],
)
def test_states_told_in_these_forms_set_these_slots(text: str, expected: tuple[str, str] | None) -> None:
    assert slot_of(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "Please note that I have relocated to Lausanne as of the first of the month.",
            [("I have relocated to Lausanne as of the first of the month", "user|home_city", "lausanne")],
        ),
        (
            "I should like to tell you that I have become engaged to a gentleman from my choir.",
            [("I have become engaged to a gentleman from my choir", None, None)],
        ),
        ("Please I have shifted to Accra now.", [("I have shifted to Accra now", None, None)]),
        (
            "I had to say I live in London on the form.",
            [("I had to say I live in London on the form", None, None)],
        ),
        ("Note that I'm a doctor in this roleplay.", []),
        ("Please note that I am a pilot for this story.", []),
        ("No more sugar in my tea for me.", [("No more sugar in my tea for me", None, None)]),
        ("Gone veggie since January.", [("Gone veggie since January", "user|diet", "vegetarian")]),
        ("Gone home.", []),
        ("Gone part-time at school.", []),
        ("No more coffee for me today, already had three.", []),
        ("No more beer for me, early start.", []),
        ("No more wine for me, I'm driving.", [("I'm driving", None, None)]),
        ("No more pizza left, the kids ate it all.", []),
        ("No longer thirsty.", []),
        ("Cut my Netflix for a month, skint.", []),
        ("Cut to part time now.", []),
        ("Cut the sugar out of my tea.", [("Cut the sugar out of my tea", None, None)]),
        ("Please note that I'm allergic to nuts.", [("I'm allergic to nuts", "user|allergy:nuts", "yes")]),
        ("Please remember I'm vegan.", []),  # a request, as without the frame
        ("Please call me Sam.", [("Please call me Sam", "user|name", "sam")]),
        (
            "me n my gf have been together since yr 10",
            [("Me and my gf have been together since yr 10", None, None)],
        ),
        ("I take a cigar on Sunday evenings.", [("I take a cigar on Sunday evenings", None, None)]),
        ("I met him on Sunday evening.", [("I met him on the evening of 2026-04-26", None, None)]),
        ("I moved on Friday.", [("I moved on 2026-04-24", None, None)]),
    ],
)
def test_statements_read_behind_frames_and_in_chat(text: str, expected: list) -> None:
    assert triples(text, NOW) == expected


@pytest.mark.parametrize(
    ("clause", "expected"),
    [
        ("I have accepted, and commenced, a post as a junior actuary", None),
        ("A tattoo studio in Brighton has taken me on as an apprentice", None),  # the user's news
        ("Just finished at the hospital", "no change word"),
        ("Amy took me on a surprise trip to Paris", "no change word"),
        ("The plant took me on as a line operator", None),
        ("I begin work at 6 every day", "no change word"),
        ("Priya and me are a couple of idiots", "no change word"),
        ("I have shifted to my auntie's place for the holidays", "plan"),
        ("Shifted up to Wellington in April 2026", None),
        ("Me and Hannah from the timber yard are an item", None),
        ("Got the keys to a terrace in Cleethorpes, though my clothes still smell of vinegar", None),
        ("I'm still in Leeds, though I've changed jobs", "restatement"),
    ],
)
def test_the_guard_reads_these_clauses(clause: str, expected: str | None) -> None:
    assert blocker(clause) == expected


@pytest.mark.parametrize(
    ("clause", "expected"),
    [
        ("I journal every night now, a page before bed", True),
        ("These days I swim every morning", True),
        ("I now run every morning", True),
        ("I worked every day last year", False),
        ("I went there every day now", False),
        ("I am here every day now", False),
        ("I now cook every night because my wife is ill", False),
        ("I now clean every day, the new puppy is a nightmare", False),
        ("I get a migraine every day now", False),
    ],
)
def test_a_habit_held_now_is_one_taken_up(clause: str, expected: bool) -> None:
    assert tells_new_habit(clause) == expected
    assert not tells_taste(clause)  # a taste of its own only against one told as not the user's


@pytest.mark.parametrize(
    ("memory", "not_mine"),
    [("I've never kept a diary", True), ("I hate exercise", True), ("I love baking", False)],
)
def test_a_taste_told_as_not_the_users(memory: str, not_mine: bool) -> None:
    assert tells_not_mine(memory) == not_mine


@pytest.mark.parametrize(
    ("clause", "expected"),
    [
        ("I swim instead of running now, three mornings a week", True),
        ("I paint exclusively in watercolour now", True),
        ("I do parkrun most Saturdays now", False),  # may go with "I love running": no contrast told
        ("I make pizza at home now", False),
        ("I don't do fry-ups anymore", True),
        ("Nowadays I mostly listen to classical", False),  # no contrast told
        ("I'm cooking mushrooms for the kids now", False),
        ("I cook every night now because my wife is ill", False),
        ("I think so now", False),
        ("I can do it now", False),
        ("I went there now", False),
    ],
)
def test_a_habit_told_as_it_is_now(clause: str, expected: bool) -> None:
    assert tells_habit_now(clause) == expected


@pytest.mark.parametrize(
    ("habit", "taste", "shared"),
    [
        ("I swim instead of running now", "I run on the treadmill at the gym", True),
        ("I don't do fry-ups anymore", "I love a big fry-up on Sunday mornings", True),
        ("I don't go to Starbucks anymore", "I love coffee", False),
        ("I don't buy CDs anymore", "I love music", False),
    ],
)
def test_a_habit_weighs_against_a_taste_only_if_they_share_a_word(
    habit: str, taste: str, shared: bool
) -> None:
    assert shares_a_word(habit, taste) == shared


@pytest.mark.parametrize(
    ("earlier", "later", "retired"),
    [
        ("I stay in Durban.", "We've packed up and gone to Joburg now.", "I stay in Durban"),
        ("I've been unemployed since March.", "Started at the Royal Mint as a quality inspector.", None),
        ("I have a boyfriend, Joost.", "Joost and me are not together anymore.", None),
    ],
)
def test_a_state_told_so_is_retired_by_its_change(earlier: str, later: str, retired: str | None) -> None:
    got = superseded(earlier, later)
    assert got == ([retired] if retired else [earlier.rstrip(".")])


@pytest.mark.parametrize(
    ("fact", "ends", "named"),
    [
        ("Sipho and I have split", True, "sipho"),
        ("Rory and I are done, it's been coming a while", True, "rory"),
        ("Jonas and I are finished", True, "jonas"),
        ("Ana and I are separating", True, "ana"),
        ("Sunita and I have decided to part ways", True, "sunita"),
        ("Me and dave are done", True, "dave"),
        ("me and hannah aren't a thing anymore", True, "hannah"),
        ("We're done", True, None),
        ("We're done, time for lunch", False, None),  # only a named partner's ending goes on after a comma
        ("We split, then regrouped at the pub", False, None),
        ("We've split up for the day, he's at the match", False, None),
        ("Tom and I are done with the kitchen", False, None),
        ("Coffee and I are done", False, None),
        ("Our band broke up last month", False, None),
        # the thirteenth set's forms (test_varieties.py)
        ("me and the gf are done", True, None),
        ("The missus and I have split up", True, None),
        ("the wife's done", False, None),
        ("Netflix ended it", False, None),
        ("Dad has left me a voicemail", False, None),
    ],
)
def test_a_partnership_ended_and_whom_it_names(fact: str, ends: bool, named: str | None) -> None:
    assert ends_partnership(fact) == ends
    assert partner_named_in_ending(fact) == named


def test_a_memory_told_of_the_partner_with_me_as_subject() -> None:
    assert names_partner("Me and my husband Sipho stay in Soweto")
    assert not names_partner("Me and my mate Sipho stay in Soweto")
