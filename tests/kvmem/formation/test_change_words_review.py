"""A review's findings on the words-of-change readings (change_guard, clauses, consolidate, formation_decisions at
f8e5d0f): each case failed there and states the behaviour kept since. The sentences are the review's own, written
apart from the sealed held-out sets."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvmem.formation.change_guard import blocker, tells_change
from kvmem.formation.rules import RuleExtractor
from kvmem.formation.types import TurnInput
from kvmem.text import MemoryStore
from tests.kvmem.formation.test_change_head import formed as formed_in

T = "2026-11-26T14:41:09.000000Z"


def formed(tmp_path: Path, texts: list[str]) -> tuple[list[str], list[str]]:
    """Each text said as one user turn and formed by the worker (rules, shipped head, default embedder):
    (current, retired)."""
    with MemoryStore(tmp_path / "m.sqlite") as store:
        return formed_in(store, texts)


def extract(text: str):
    return RuleExtractor().extract([TurnInput("t1", "user", text, T)])


# 1. _DATED's ISO alternative: a relative date the rules resolved and put first ("Yesterday" -> "On 2026-11-25")
#    leaves nothing "before" it, so _ahead reads every such past change as a plan
@pytest.mark.parametrize(
    "text",
    [
        "On 2026-11-25 I got the keys to my new flat in Leeds",
        "In the week of 2026-11-16 I moved to Leeds",
        "On 2026-11-23 I started my new job at Aldi",
    ],
)
def test_a_leading_resolved_past_date_is_not_a_plan(text: str) -> None:
    assert blocker(text) is None


def test_yesterdays_keys_to_a_new_flat_retire_the_old_home(tmp_path: Path) -> None:
    _, retired = formed(tmp_path, ["I live in York.", "Yesterday I got the keys to my new flat in Leeds."])
    assert retired == ["I live in York."]


# 2. _AND_BUT now splits at "so": the date that made the whole sentence a plan stays in the left clause and the
#    right one ("we're moving to Leeds") reads as a change made
@pytest.mark.parametrize(
    ("memory", "said"),
    [
        ("I live in York.", "Our lease runs out next month so we're moving to Leeds."),
        ("I live in York.", "My contract ends in March so I'm moving back to Leeds."),
        ("I work as a nurse at St Mary's.", "The baby's due in May so I'm quitting my job."),
    ],
)
def test_a_plan_dated_before_so_retires_nothing(tmp_path: Path, memory: str, said: str) -> None:
    _, retired = formed(tmp_path, [memory, said])
    assert retired == []


# 3. _SELF: "My husband and I" / "My partner and I" is the user as a subject, but only "<Name> and I" is listed,
#    so "... and moved to Spain" is no longer split off and the home slot is lost
@pytest.mark.parametrize(
    "said", ["My husband and I retired and moved to Spain.", "My partner and I sold up and moved to Spain."]
)
def test_my_partner_and_i_then_a_dropped_subject_keeps_the_move(tmp_path: Path, said: str) -> None:
    assert ("user|home_city", "spain") in {(f.slot, f.value) for f in extract(said)}
    _, retired = formed(tmp_path, ["I live in Leeds.", said])
    assert retired == ["I live in Leeds."]


# 4. new _CHANGES words that are everyday non-changes, now enough in a single-valued area (strict tells_change)
@pytest.mark.parametrize(
    "text",
    [
        "I've worked at Tesco for a couple of years",  # "(?:a|an) (?:thing|item|couple)"
        "I've been at the hospital for a couple of decades",
        "I pay into a pension at work",  # "pension"
        "I'm out of my depth at the bank",  # "(?:I'm|...) (?:\w+ )?out of"
    ],
)
def test_everyday_wording_tells_no_change(text: str) -> None:
    assert not tells_change(text, strict=True)


@pytest.mark.parametrize(
    ("memory", "said"),
    [
        ("I work as a cashier at Tesco.", "I've worked at Tesco for a couple of years."),
        ("I work as a nurse at St Mary's.", "I've been at the hospital for a couple of decades."),
        ("I work as a nurse at St Mary's.", "I pay into a pension at work."),
        ("I work at the bank.", "I'm out of my depth at the bank."),
    ],
)
def test_a_non_change_retires_no_job(tmp_path: Path, memory: str, said: str) -> None:
    _, retired = formed(tmp_path, [memory, said])
    assert retired == []


# 5. _users_news/_PARTNERS: "^(?:\w+ )*?" finds a partner word anywhere, so any other person's news that
#    mentions someone's husband or boyfriend and "us"/"me" is read as the user's
@pytest.mark.parametrize(
    "text",
    [
        "My daughter and her husband moved to Perth to be near us",
        "My sister moved in with her boyfriend down the road from us",
        "My husband's ex moved in next door to us",
    ],
)
def test_another_persons_move_near_us_is_theirs(text: str) -> None:
    assert blocker(text) == "another person"


def test_my_daughters_move_keeps_my_home(tmp_path: Path) -> None:
    _, retired = formed(
        tmp_path, ["I live in York.", "My daughter and her husband moved to Perth to be near us."]
    )
    assert retired == []


# 6. _NEGATION's "(?:nearly|almost) (?=\w+ed\b...)": any -ed word, not only a change weighed and not made
def test_almost_finished_unpacking_is_not_a_negated_move(tmp_path: Path) -> None:
    said = "Moved into the new flat in Leeds, almost finished unpacking"
    assert blocker(said) is None
    _, retired = formed(tmp_path, ["I live in York.", said + "."])
    assert retired == ["I live in York."]


# 7. _PLAN's "(?:had|have) an? (?:\w+ )?(?:dream|nightmare)": "a nightmare week", "a dream job" are no plans
@pytest.mark.parametrize(
    "text", ["I had a nightmare first week at the new job", "I finally have a dream job at the BBC"]
)
def test_a_nightmare_or_dream_x_is_not_a_plan(text: str) -> None:
    assert blocker(text) != "plan"


def test_a_nightmare_first_week_at_a_new_job_retires_the_old_one(tmp_path: Path) -> None:
    _, retired = formed(
        tmp_path, ["I work as a nurse at St Mary's.", "I had a nightmare first week at the new job."]
    )
    assert retired == ["I work as a nurse."]


# 8. _DATED's ordinal and "the end of <month>": an ordinal that is no day, and a date after "since", are no plan
@pytest.mark.parametrize(
    "text",
    [
        "We're in our new place in Leeds on the 3rd floor now",
        "I live in the 11th arrondissement of Paris now",
        "I've been living in Leeds since the end of March",
    ],
)
def test_an_ordinal_or_a_since_date_is_not_a_plan(text: str) -> None:
    assert blocker(text) is None


# 9. readings.encoded_retirement: tells_change without `strict` lets words of how long ("been cooking")
#    open tastes to the pair encoder, the very mention the gate is there to stop
def test_cooking_mushrooms_for_the_kids_keeps_the_dislike(tmp_path: Path) -> None:
    _, retired = formed(tmp_path, ["I can't stand mushrooms.", "I've been cooking mushrooms for the kids."])
    assert retired == []
