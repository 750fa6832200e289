"""Changes of state told in the forms the thirteenth sealed set's misses showed (issue 45 item 3, read after it was
scored once), as far as two reviews left them: Scots "That's me retired fae the yard" and "I'm nae a postie any more",
chat's "jus quit", non-native "Since two weeks I live in Wrocław", "I live with my parents in Kraków", "I'm in X now,
renting a room / closed on the condo", "me and the gf are done", thanks before the news ("Alhamdulillah I am now
working as ..."). What the reviews found read wrongly (of 2840e49 and b3d427e), kept here as it is read since:
"That's me retired to bed / from five-a-side / single for the night / left work", "I'm nae working the morra", "jus"
as a word ("Jus de fruits"), "I live with my mum in August / in Mum's house", "I'm in Rome now, renting a villa for
the holiday / a room until Friday", "Me and the wife are done, time for bed", and the slots' own over-readings the new
forms led into: "I've just left the office", "I'm not working today", "I've just retired my old laptop", notice on a
flat, a job application, a trailing "okay" cut from "My mum is okay". The forms the reviews found too broad to keep
(Irish "I'm after ...ing", Caribbean "I done ...", a job's years said first, a dropped subject's "Work at ...", "I've
started as", "a coffee person", "<Name> ended it") are read as before. Development examples written apart from the
sealed sets."""

from __future__ import annotations

import pytest

from kvmem.formation.change_guard import names_partner
from kvmem.formation.clause_subject import standard_english
from kvmem.formation.rules import slot_of
from tests.kvmem.formation.test_state_changes import superseded, triples

NOW = "2026-05-01T10:00:00+00:00"  # a Friday


@pytest.mark.parametrize(
    ("said", "standard"),
    [
        ("That's me retired fae the yard", "I'm retired from the yard"),
        ("That's me retired", "I'm retired"),
        ("That's me redundant, gutted", "I'm redundant, gutted"),
        ("That's me retired to bed", "That's me retired to bed"),
        ("That's me retired from the pub quiz team", "That's me retired from the pub quiz team"),
        ("That's me unemployed for the summer", "That's me unemployed for the summer"),
        ("That's me single for the night", "That's me single for the night"),
        ("That's me left work", "That's me left work"),
        ("I'm nae a postie any more", "I'm not a postie any more"),
        ("I'm after leaving the job", "I'm after leaving the job"),  # Irish or "looking to": left as said
        ("I done retire from nursing", "I done retire from nursing"),
    ],
)
def test_a_change_said_in_scots_read_in_the_standard_form(said: str, standard: str) -> None:
    assert standard_english(said) == standard


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("That's me retired fae the yard.", ("user|job", "retired")),
        ("I'm nae a postie any more.", ("user|job", "not:postie")),
        ("I'm nae working the morra.", None),
        ("Since two weeks I live in Wrocław.", ("user|home_city", "wrocław")),
        ("Since a few months I work as a nurse in Graz.", ("user|job", "nurse")),
        ("I live with my parents in Kraków.", ("user|home_city", "kraków")),
        ("I live with my parents in term time.", None),
        ("I live with my mum in August.", None),
        ("I live with my sister in Mum's house.", None),
        ("We're in Jersey City now, closed on the condo in April.", ("user|home_city", "jersey city")),
        ("I'm in Christchurch now, renting two streets from my brother.", ("user|home_city", "christchurch")),
        ("I'm in Berlin now, renting a room.", ("user|home_city", "berlin")),
        ("I'm in Rome now, renting a car for the week.", None),
        ("I'm in Rome now, renting a villa for the holiday.", None),
        ("I'm in Rome now, renting a room near the Vatican until Friday.", None),
        ("I'm in Lisbon now, staying with friends.", None),
        ("I'm in Leeds now, bought a flat for my sister.", None),
        ("Alhamdulillah I am now working as pharmacist in a hospital in Lahore.", ("user|job", "pharmacist")),
        ("I'm after leaving the hotel.", None),
        ("Seven years a paramedic now.", None),
        ("Work at the hospital was brutal today.", None),
        ("I've become a coffee person.", None),
        ("Netflix ended it after two seasons.", None),
        # the slots' own over-readings
        ("I've just left the office.", None),
        ("Just left work.", None),
        ("I've just left my job.", ("user|job", "none")),
        ("I just left the firm.", ("user|job", "none")),
        ("I've just left the hospital after 30 years as a nurse.", ("user|job", "none")),
        ("I've just retired my old laptop.", None),
        ("I retired this spring.", ("user|job", "retired")),
        ("I've handed in my notice on the flat.", None),
        ("I've lost my job application.", None),
        ("I'm not working today.", None),
        ("I'm not working for now.", ("user|job", "none")),
        ("Not working at the moment.", ("user|job", "none")),
        ("My mum is okay.", None),
    ],
)
def test_states_told_in_these_forms_set_these_slots(text: str, expected: tuple[str, str] | None) -> None:
    assert slot_of(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("jus quit my job lol", [("Just quit my job", "user|job", "none")]),
        ("Told the chef where to put his jus.", [("Told the chef where to put his jus", None, None)]),
        (
            "Jus de fruits is my favourite drink.",
            [("Jus de fruits is my favourite drink", "user|favourite:drink", "jus de fruits")],
        ),
        ("Thank god my mum is okay.", [("My mum is okay", None, None)]),
        ("Alhamdulillah we moved to Dubai.", [("We moved to Dubai", "user|home_city", "dubai")]),
        ("Omg I'm in Vegas now!", []),  # only thanks are read past, not every cheer
        ("Meeting finished and I've left the office.", []),
        ("Emeritus now, so officially retired.", []),
    ],
)
def test_statements_read_in_these_forms(text: str, expected: list) -> None:
    assert triples(text, NOW) == expected


def test_a_partner_named_with_an_accent_is_found_in_the_memory() -> None:
    assert names_partner("My girlfriend Inês lives in Porto", "inês")
    assert not names_partner("My girlfriend Ana lives in Porto", "inês")


@pytest.mark.parametrize(
    ("earlier", "later", "retired"),
    [
        ("I'm a postie.", "I'm nae a postie any more.", "I'm a postie"),
        ("I live in Kraków.", "Since two weeks I live in Wrocław.", "I live in Kraków"),
        ("I live with my parents in Kraków.", "I live in Wrocław now.", "I live with my parents in Kraków"),
    ],
)
def test_a_state_is_retired_by_its_change_told_so(earlier: str, later: str, retired: str) -> None:
    assert superseded(earlier, later) == [retired]
