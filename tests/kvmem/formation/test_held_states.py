"""States held and ended in the forms people use (issue 45 item 3, after the eleventh sealed set was read): a home,
a job or a partner told as held ("We rent a semi in Derby", "I run a bakery", "I've been married to Ann for years"),
so that a later change has a slot to retire; endings told without the words the earlier rules knew ("got the sack",
"we called the engagement off"); statements after a leading phrase with no comma. And what a review of the first
version (c401cdb) found read wrongly, kept here as it is read since: a home for a while or someone else's, a role
for the evening, a hobby, a bank "been with" for years, a refusal of a drink, a sack of compost. Development
examples written apart from the sealed sets."""

from __future__ import annotations

import pytest

from kvmem.formation.change_guard import blocker, ends_partnership
from kvmem.formation.rules import slot_of
from tests.kvmem.formation.test_state_changes import superseded, triples

NOW = "2026-05-01T10:00:00+00:00"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # a home rented, the place said last
        ("We rent a semi in Derby.", ("user|home_city", "derby")),
        ("I rent a little flat in Bath.", ("user|home_city", "bath")),
        ("We're renting a two-bed in Hove.", ("user|home_city", "hove")),
        ("We rent a cottage in Wales for the summer.", None),
        ("I've got a flat in Paris.", None),  # owned or "got": it may be a second home
        ("We've got a friend with a flat in Madrid.", None),
        ("I'm still living in the Leeds house.", ("user|home_city", "leeds")),
        ("We completed on a bungalow in Ripon.", ("user|home_city", "ripon")),
        ("We've moved back home to Cork.", ("user|home_city", "cork")),
        ("I went home to Sligo for the weekend.", None),
        # a job held
        ("I'm a ticket inspector on the trains.", ("user|job", "ticket inspector")),
        ("I'm a civil servant.", ("user|job", "civil servant")),
        ("I am data engineer at a bank in Porto.", ("user|job", "data engineer")),
        ("I'm driver for the school run this week.", None),
        ("I'm DJ at my mate's wedding.", None),
        ("I'm the chef in our house.", None),
        ("I'm a glorified porter at this point.", None),
        ("I'm a keen gardener.", None),
        ("I run a small bakery in Frome.", ("user|job", "runs a small bakery")),
        ("I run a stall at the car boot on Sundays.", None),
        ("I run a book club.", None),
        ("I've gone into insurance.", ("user|job", "insurance")),
        ("I've gone into survival mode.", None),
        ("I've gone into labour.", None),
        (
            "Started at the county council's planning office on 2026-04-27.",
            ("user|employer", "county council's planning office"),
        ),
        ("I started at the local college in September.", None),
        ("I started at the office at 8.", None),
        # a job ended
        ("I got the sack yesterday.", ("user|job", "none")),
        ("I got the sack, from the band.", None),
        ("I got the sack on my first job back in 1999.", None),
        ("I got the sack of compost in from the car.", None),
        ("I got the boot open.", None),
        ("I'm done at the pub for good, they banned me.", None),
        ("I'm done at the hospital, heading home.", None),
        ("I quit smoking.", ("user|likes:smoking", "no")),
        (
            "I quit the sandwich place, the hours were awful.",
            None,
        ),  # a job, not a taste: left to the learned readings
        ("Gave up the bar job, been skint since.", ("user|job", "none")),
        # a partner held or gone
        ("I've been married to Ann for thirty years.", ("user|relationship", "married")),
        ("We've been together since uni.", None),  # it retired "I'm married" once
        ("I've been married for ten years before the divorce.", None),
        ("I've been with Barclays since 2015.", None),
        ("Mum's left me for the weekend.", None),
        ("It's all over with Ofsted.", None),
        ("The divorce came through yesterday.", ("user|relationship", "divorced")),
        ("My divorce came through in 1998.", None),
        ("The divorce came through for my sister.", None),
        ("We called the engagement off.", ("user|relationship", "single")),
        ("The engagement's off.", ("user|relationship", "single")),
        ("The wedding's off until 2027.", None),
        ("Jo and I are done.", None),  # a brother or a business partner as well
        # tastes
        ("I've never liked olives.", ("user|likes:olives", "no")),
        ("I've never liked olives until now.", None),
        ("I love running, the longer the better.", ("user|likes:running", "yes")),
        ("I love running, swimming and cycling.", None),  # a list: no one slot
        ("I've gone right off crisps, can't face them.", ("user|likes:crisps", "no")),
        ("I've fallen in love with bouldering.", ("user|likes:bouldering", "yes")),
        ("I fell for a scam.", None),
        ("I'm a big rugby fan.", ("user|likes:rugby", "yes")),
        ("I'm a big fan.", None),
        ("I'm a former Chelsea fan.", None),
        ("No wine for me, I'm driving.", None),
        ("I binned the leftovers.", None),
        ("I've properly got into baking.", ("user|likes:baking", "yes")),
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
        ("I'm engaged to Kit.", "We called the engagement off.", "I'm engaged to Kit"),
        ("I run a small bakery in Frome.", "I got the sack.", None),
    ],
)
def test_a_held_state_is_retired_by_its_change(earlier: str, later: str, retired: str | None) -> None:
    got = superseded(earlier, later)
    assert got == ([retired] if retired else [earlier.rstrip(".")])


@pytest.mark.parametrize(
    ("earlier", "later"),
    [
        ("I live in Leeds.", "We rent a cottage in Devon for the week."),
        ("I live in Leeds.", "I went home to Sligo for Christmas."),
        ("I'm a nurse.", "I'm the designated driver for tonight."),
        ("I'm a nurse.", "I'm a glorified porter at this point."),
        ("I'm a teacher.", "I got the sack of compost in from the car."),
        ("I'm married to Tom.", "I've been with Barclays since 2015."),
        ("I love wine.", "No wine for me, I'm driving."),
        ("I love flying.", "I've always hated flying, but now I love it."),
        # a wedding to come is a plan, not "married" (it retired "together since 2019" once both read a slot)
        ("My boyfriend and I have been together since 2019.", "We're getting married next June."),
    ],
)
def test_what_the_review_found_retires_nothing(earlier: str, later: str) -> None:
    assert superseded(earlier, later) == []


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
        (
            "From this week I am in early retirement.",
            [("From the week of 2026-04-27 I am in early retirement", "user|job", "retired")],
        ),
        ("Twenty years' service done, retired in March.", [("Retired in March", "user|job", "retired")]),
        ("Party over, went home to Leeds.", []),  # not a term of work or a stay: nothing split off
        ("Resigned. No regrets.", [("Resigned", "user|job", "none")]),
        ("Separated.", []),  # eggs, as well
        ("The kids loved it, went home after.", []),
        ("I swear.", []),
        ("No, I live in York.", [("I live in York", "user|home_city", "york")]),
    ],
)
def test_statements_after_a_leading_phrase(text: str, expected: list) -> None:
    assert triples(text, NOW) == expected


@pytest.mark.parametrize(
    ("clause", "expected"),
    [
        ("I've been going to quit for years", "plan"),
        ("I'm going to quit", "plan"),
        ("We sold up and moved north", None),
        ("I got the sack", None),
        ("We called the engagement off", None),
        ("I called the plumber off", "no change word"),
        ("I binned the leftovers", "no change word"),
        ("I handed the kids over to their dad", "no change word"),
        ("Now I'm a convert", None),
    ],
)
def test_the_guard_reads_these_changes(clause: str, expected: str | None) -> None:
    assert blocker(clause) == expected


@pytest.mark.parametrize(
    ("fact", "ends"),
    [
        ("Lou and I have separated", True),
        ("Alex and I have called it a day", True),
        ("We broke up last week", True),
        ("Our band broke up last month", False),
        ("We've split up for the day, he's at the match", False),
        ("We've separated the dogs, they kept fighting", False),
        ("We split the bill", False),
    ],
)
def test_only_a_break_up_lets_a_memory_of_the_partner_be_retired(fact: str, ends: bool) -> None:
    assert ends_partnership(fact) == ends
