"""The rules' guard over the "self" extractor's updates (kvmem/formation/change_guard.py): which clauses can
stand behind a supersession. The sentences are this test's own, written apart from the sealed held-out sets
(benchmarks/data/state_changes), which are for reporting only."""

from __future__ import annotations

import pytest

from kvmem.formation.change_guard import BLOCKERS, blocker, other_area, turn_blocker


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
        ("I do some tutoring on the side", "addition"),
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
