"""The rules' guard over the "self" extractor's updates (kvmem/formation/change_guard.py): which clauses can
stand behind a supersession. The sentences are this test's own, written apart from the sealed held-out sets
(benchmarks/data/state_changes), which are for reporting only."""

from __future__ import annotations

import pytest

from kvmem.formation.change_guard import (
    BLOCKERS,
    blocker,
    other_area,
    same_value,
    tells_change,
    turn_blocker,
)
from kvmem.formation.change_words import says_given_up, says_state_change
from kvmem.formation.tastes_told import tells_taste


@pytest.mark.parametrize(
    "clause",
    [
        "I quit the newspaper in March",
        "moved to Gdansk over the summer",
        "I've been a welder for eleven years",
        "I don't drink beer anymore",
        "I no longer teach piano",
        "I'm not with Oskar these days",
        "my girlfriend dumped me",
        "my husband and I separated",
        "I retired from the post office",
        "I can't stand red meat now",
        "I've been going to the climbing gym every week",
        "I started at the hospital pharmacy",
        "we relocated to Tampere",
        "I moved in March",  # a month, said in the past
        "Since the spring I've been cycling to work",
        "I handed in my notice",
        "Tomasz and I called it a day",
        "Tomasz and I broke up, the distance was too much",  # "too" before a word is not "also"
        "I retired in March and am loving it",  # the present comes after the date
        "I quit, and the next month I started at the bakery",  # "the next month": a story, not a plan
        "Since March I don't eat meat",  # the leading "since" says the state ended
        "I took a job at the hospital",
        "We bought a house in Bergen",
        "I eat meat again",
        "I started at the Red Cross in October",
        "I'm finally out of the student halls",
        "Got a flat above the bakery in Truro",
        "Cleared out my desk at the depot on Friday",
        "that's nursing done for me",
        "Tilly and I are exclusive",
        "Sam and I are done",
        "I drew my pension in May",
        "my wife left me",  # a partner's news told with the user in it
        "my boyfriend moved in with me",
        "my brother and I sold the flat in Derby",  # the user a subject beside another
        "I moved out on 2026-04-20",  # a day already past
        "I quit on the 4th",
        "He proposed on the ferry",  # a third person's pronoun whose news is the user's partnership
        "She asked me out after the gig",
        "They let me go after eleven years",  # the user's job, ended by another
        "they laid us off last spring",
        "they laid us off in the spring",  # "laid" is a past verb: the season is behind
        "They moved me to the Leeds office",  # the user's job, moved by another
        "Greta and I are separating",
        "Me and takeaways are finished",
        "No more night shifts for me, I couldn't keep it up",  # "no more" says the state ended
        "Not gonna lie, I quit the band",  # a way of speaking, not a negation or a plan
        "Not to be dramatic but I'm done with the gym",
    ],
)
def test_a_change_of_the_users_own_state_is_not_blocked(clause: str) -> None:
    assert blocker(clause) is None


@pytest.mark.parametrize(
    ("clause", "reason"),
    [
        ("My cousin quit the newspaper", "another person"),
        ("our landlord moved to Spain", "another person"),
        ("my older brother's wife started a bakery", "another person"),
        ("I didn't accept the offer", "negated"),
        ("I never went through with the move", "negated"),
        ("I'm going to hand in my notice", "plan"),
        ("I might switch to decaf", "plan"),
        ("I applied for a job at the museum", "plan"),
        ("I'd love to live by the sea", "plan"),
        ("I still work at the garden centre", "restatement"),
        ("like I said, I'm a dentist", "restatement"),
        ("I also picked up weekend shifts at a bar", "addition"),
        ("I got another cat", "addition"),
        ("I've taken up bouldering too", "addition"),
        ("I do some tutoring on the side", "addition"),
        ("Grandad retired from the railway", "another person"),  # no "my": still someone else
        ("my eldest moved out to study in Ghent", "another person"),
        ("My old sergeant finally retired last week", "another person"),
        ("my mother-in-law moved to Leeds", "another person"),
        ("I start at the bakery in October", "plan"),  # a month still to come, said in the present
        ("we're moving to Turku in the summer", "plan"),
        ("we're getting married next May", "plan"),
        ("I keep wondering whether to retrain", "plan"),
        ("I start at the Red Cross in October", "plan"),  # "Red" is no past tense
        ("I get married in June", "plan"),
        ("I'm excited to start at the museum in June", "plan"),
        ("I'm not going anywhere", "restatement"),
        ("I've started running too and love it", "addition"),
        ("I live in New York", "no change word"),  # "new" alone is no change
        ("I start every day with a coffee", "no change word"),
        ("I sometimes wonder about leaving teaching", "plan"),
        ("Still no dairy for me", "restatement"),  # leading "still", which the subject reading strips
        ("staying put at the council", "restatement"),
        ("we grabbed a pizza to celebrate", "no change word"),
        ("I always read the small print", "no change word"),
        ("we decided against the move to Bath", "negated"),  # a change weighed and not made
        ("I turned the headteacher job down", "negated"),
        ("I talked myself out of quitting", "negated"),
        ("I had a weird dream that I moved to Peru", "plan"),  # a dream is no change
        ("I'm taking six weeks of leave from the library", "plan"),  # an absence that ends
        ("my husband got a job at the same bank as me", "another person"),  # the user only in a comparison
        ("my cousin Mia got divorced, she's staying with us", "another person"),  # not a partner: not ours
        ("my daughter's come to work with me at the salon", "another person"),
        ("my deskmate left the council", "another person"),
        ("we nearly moved to Derby but the sale fell through", "negated"),
        ("my last shift at the depot is Friday the 9th", "plan"),  # a last day still to come
        ("I start as a porter at the Royal on the 3rd", "plan"),  # a day of the month, said in the present
        ("I'm retiring at the end of June", "plan"),
        ("I've accepted an offer at a law firm", "plan"),
        ("we bought a holiday cabin in the Lakes", "addition"),
        ("I picked up some evening shifts at the pub", "addition"),
        ("He's moved back to Galway", "another person"),  # a third person's pronoun as the subject
        ("she quit the choir after the row", "another person"),
        ("They sold the farm and moved to Perth", "another person"),
        ("our next-door neighbours split up", "another person"),  # a hyphenated word before the person
        ("my two-year-old son started nursery", "another person"),
        ("My trainee has left for a rival salon", "another person"),
        ("I'm learning Welsh along with the day job", "addition"),
        ("I tried giving up crisps for Lent", "negated"),  # an attempt, not a change
        ("I almost dropped the evening class", "negated"),
        ("From Monday I'm cutting out fizzy drinks", "plan"),  # a weekday still to come
        ("I'm quite happy in Leeds", "no change word"),  # "quite" is not "quit"
    ],
)
def test_a_clause_that_changes_nothing_of_the_user_is_blocked_with_its_reason(
    clause: str, reason: str
) -> None:
    assert blocker(clause) == reason and reason in BLOCKERS


def test_the_turn_is_read_at_the_clause_the_fact_came_from() -> None:
    turn = ["My cousin moved to Tallinn. I switched to oat milk."]
    assert turn_blocker("The user's cousin moved to Tallinn", turn) == "another person"
    assert turn_blocker("I drink oat milk", turn) is None  # no word shared: every clause is read, one passes
    assert turn_blocker("I switched to oat milk", turn) is None
    assert turn_blocker("I like tea", ["thanks, bye!"]) == "no statement"


@pytest.mark.parametrize(
    ("fact", "memory", "same"),
    [
        ("I live in Tartu these days.", "I live in Tartu.", True),
        ("I live in Tartu these days.", "I live in Riga.", False),  # the same slot, another value
        ("I work at Acme.", "I live in Acme.", False),
        ("We went out to celebrate.", "We went out to celebrate.", False),  # no slot read: nothing to say
    ],
)
def test_same_value_is_the_same_slot_and_value_as_the_rules_read_them(
    fact: str, memory: str, same: bool
) -> None:
    assert same_value(fact, memory) is same


@pytest.mark.parametrize(
    ("fact", "memory", "other"),
    [
        ("I now work as a nurse", "I work at Acme.", False),  # job and employer: one area, "work"
        ("I now work as a nurse", "I live in Lisbon.", True),
        ("I moved to Berlin", "I work at Acme.", True),
        ("We split up", "My wife is Ana.", False),  # the relationship and a partner's name: "partner"
        ("I eat meat again", "I love tofu.", False),  # diet and tastes: "taste"
        ("My sister moved to Rome", "I live in Lisbon.", True),  # her city is not the user's
        ("I married Tom", "I live in Lisbon.", False),  # no slot read in the fact: nothing to say
        ("I moved to Berlin", "Rex died.", False),  # none read in the memory
    ],
)
def test_other_area_blocks_only_where_both_slots_are_read_and_differ(
    fact: str, memory: str, other: bool
) -> None:
    assert other_area(fact, memory) is other


@pytest.mark.parametrize(
    ("clause", "told"),
    [
        ("Weirdly I love olives now", True),
        ("I'm a tea person these days", True),
        ("I've gone full vinyl", True),
        ("I've turned into a gym person", True),
        ("I'm properly hooked on crosswords", True),
        ("I'm strangely into birdwatching now", True),
        ("I've come round to jazz", True),
        ("I cooked olives for the kids", False),  # a mention, not a taste
        ("I moved into a flat", False),  # "into" after another verb
        ("I'm a nurse now", False),  # a job: no "person", "fan", ...
        ("they love them", False),
    ],
)
def test_tells_taste_reads_a_taste_told_as_the_users(clause: str, told: bool) -> None:
    assert tells_taste(clause) is told


@pytest.mark.parametrize(
    ("clause", "told"),
    [
        ("Uninstalled Fortnite and cancelled the pass", True),
        ("I've been a welder for years", True),  # not strict: words of how long count
        ("I stopped singing in the choir", True),
        ("I'm cooking mushrooms for the kids now", False),  # "now" only says when
        ("I finally made it to the allotment", False),
        ("I might stop singing in the choir", False),  # blocked: a plan
    ],
)
def test_tells_change_needs_a_word_of_change_beyond_when(clause: str, told: bool) -> None:
    assert tells_change(clause) is told


def test_tells_change_strict_needs_more_than_how_long_or_since_when() -> None:
    assert tells_change("We rented a cottage in Keswick", strict=True)
    assert not tells_change("I've been a welder for years", strict=True)
    assert not tells_change("I have since found chemistry useful", strict=True)
    assert not tells_change("I just wanted to get my food and leave", strict=True)
    assert not tells_change("I'm learning a lot on the course", strict=True)
    # "any more" after a negation says a state is over ("I don't know any more" says nothing of one)
    assert tells_change("Not seeing Rafa any more", strict=True)
    assert tells_change("I don't go to the gym anymore", strict=True)
    assert not tells_change("I don't know anymore", strict=True)


@pytest.mark.parametrize(
    ("clause", "given_up", "state"),
    [
        ("I've gone right off cider", True, True),
        ("I've stopped doing the pub quiz", True, True),
        ("My knee put a stop to the running", True, True),
        ("Not seeing Rafa any more", True, True),
        ("I use a toner to stop the shine", False, True),  # "to stop": a purpose, not a taste given up
        ("I've taken up the cello", False, False),  # a taste taken up: no home, job or partner
        ("I left the bakery before I got into pottery", False, True),
    ],
)
def test_given_up_and_a_change_of_state_are_read_apart_from_a_taste_taken_up(
    clause: str, given_up: bool, state: bool
) -> None:
    assert says_given_up(clause) is given_up
    assert says_state_change(clause) is state
