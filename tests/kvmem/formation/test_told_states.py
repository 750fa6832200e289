"""Changes of state told in the forms the twelfth sealed set's misses showed (issue 45 item 3, read after it was
scored once): a statement behind a frame that only announces it ("Please note that I have relocated to Lausanne",
"I am pleased to report that ..."), a move "shifted" to or "packed up and gone" to, "I stay in Durban" as where one
lives, a post taken "as a quality inspector", "I've been unemployed since March", "X and me are not together
anymore", chat's "n" for "and"; the guard's words of change ("commenced", "taken me on", "finished at the Red Lion")
and its restatement word read only before a concessive; a habit held now as a taste; and "on Sunday evenings" left
alone as a habit, not resolved to one evening. Development examples written apart from the sealed sets."""

from __future__ import annotations

import pytest

from kvmem.formation.change_guard import blocker, tells_taste
from kvmem.formation.rules import slot_of
from tests.kvmem.formation.test_state_changes import superseded, triples

NOW = "2026-05-01T10:00:00+00:00"  # a Friday


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("I stay in Durban, near the beachfront.", ("user|home_city", "durban")),
        ("I stay in hotels when I travel.", None),
        ("I stay in Rome for a week.", None),
        ("I stay in on Fridays.", None),
        ("We've packed up and gone to Joburg now.", ("user|home_city", "joburg")),
        ("I've shifted to Accra now.", ("user|home_city", "accra")),
        ("Shifted up to Wellington last month.", ("user|home_city", "wellington")),
        ("Got a proper flat in Lincoln now.", ("user|home_city", "lincoln")),
        ("Started at the Royal Mint on Monday as a quality inspector.", ("user|job", "quality inspector")),
        (
            "I have accepted, and commenced, a post as a junior actuary with a pensions consultancy.",
            ("user|job", "junior actuary"),
        ),
        ("I joined the choir as a tenor.", None),
        ("I started at the club as a sub.", None),
        ("Joined the gym as a member.", None),
        ("I have been unemployed since March.", ("user|job", "none")),
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
        ("Please I have shifted to Accra now.", [("I have shifted to Accra now", "user|home_city", "accra")]),
        ("Note that I'm allergic to nuts.", [("I'm allergic to nuts", "user|allergy:nuts", "yes")]),
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
        ("I've finished at the Red Lion, the new landlord was a nightmare", None),
        ("I finished at the office early today", "no change word"),
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
    ],
)
def test_a_habit_held_now_tells_a_taste(clause: str, expected: bool) -> None:
    assert tells_taste(clause) == expected


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
