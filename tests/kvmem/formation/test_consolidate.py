"""kvmem.formation.consolidate: the exact decision for each rule, and batches that consolidate against
themselves."""

from __future__ import annotations

import pytest

from kvmem.formation.consolidate import (
    BatchConsolidation,
    ConsolidationConfig,
    ExistingMemory,
    Supersession,
    consolidate,
    consolidate_batch,
    word_overlap,
)
from kvmem.formation.types import Decision, Fact

T1 = "2026-03-01T10:00:00.000000Z"
T2 = "2026-11-26T14:41:09.000000Z"


def fact(text: str, slot: str | None = None, value: str | None = None, valid_from: str = T2) -> Fact:
    return Fact(text, ("t",), valid_from, "fact", slot, value)


LISBON = ExistingMemory("m1", "I live in Lisbon", "user|home_city", "lisbon", T1)
COFFEE = ExistingMemory("m2", "I love coffee", "user|likes:coffee", "yes", T1)
NURSE = ExistingMemory("m3", "I'm a nurse", "user|job", "nurse", T1)
SIEMENS = ExistingMemory("m4", "I work at Siemens", "user|employer", "siemens", T1)
TRIP = ExistingMemory("m5", "I went to Rome in May", None, None, T1)


def test_same_normalized_text_is_a_duplicate() -> None:
    assert consolidate(fact("i live in LISBON!"), [LISBON, COFFEE]) == Decision("duplicate", ("m1",))


def test_same_slot_and_value_is_a_duplicate() -> None:
    got = consolidate(fact("I'm living in Lisbon now", "user|home_city", "lisbon"), [LISBON, COFFEE])
    assert got == Decision("duplicate", ("m1",))


def test_same_slot_other_value_supersedes_every_such_memory() -> None:
    porto = ExistingMemory("m9", "We live in Porto", "user|home_city", "porto", T1)
    got = consolidate(fact("I moved to Berlin", "user|home_city", "berlin"), [LISBON, COFFEE, porto])
    assert got == Decision("supersede", ("m1", "m9"))
    got = consolidate(fact("I don't drink coffee anymore", "user|likes:coffee", "no"), [LISBON, COFFEE])
    assert got == Decision("supersede", ("m2",))


def test_an_older_fact_supersedes_nothing_and_is_outdated() -> None:
    """Issue 42 item 12: an older fact about a slot a newer memory sets otherwise was "add": two current
    values of one slot. It is "outdated": added already superseded by the newest such memory."""
    old = fact("I moved to Berlin", "user|home_city", "berlin", valid_from="2025-01-01T00:00:00.000000Z")
    assert consolidate(old, [LISBON]) == Decision("outdated", ("m1",))
    newest = ExistingMemory("m8", "I live in Porto", "user|home_city", "porto", T2)
    assert consolidate(old, [LISBON, newest, COFFEE]) == Decision("outdated", ("m8",))
    same_time = fact("I moved to Berlin", "user|home_city", "berlin", valid_from=T1)
    assert consolidate(same_time, [LISBON]) == Decision("supersede", ("m1",))
    unknown = ExistingMemory("m6", "I live in Lisbon", "user|home_city", "lisbon", "")
    assert consolidate(old, [unknown]) == Decision("supersede", ("m6",))


def test_said_at_decides_where_both_are_known() -> None:
    # "My sister moved to Porto last year" (valid_from 2025-01-01) said after "My sister lives in Rome"
    rome = ExistingMemory("m7", "My sister lives in Rome", "sister|home_city", "rome", T1, said_at=T1)
    moved = fact(
        "My sister moved to Porto in 2025", "sister|home_city", "porto", "2025-01-01T00:00:00.000000Z"
    )
    assert consolidate(moved, [rome]) == Decision("outdated", ("m7",))  # by valid_from alone: older
    assert consolidate(moved, [rome], said_at=T2) == Decision("supersede", ("m7",))
    assert consolidate(moved, [rome], said_at="2025-06-01T00:00:00Z") == Decision(
        "outdated", ("m7",)
    )  # old log


def test_a_fact_without_a_slot_never_supersedes() -> None:
    assert consolidate(fact("I visited Berlin last week"), [LISBON]) == Decision("add")


def test_negated_value_supersedes_only_that_value() -> None:
    vegan = ExistingMemory("m8", "I'm vegan", "user|diet", "vegan", T1)
    vegetarian = ExistingMemory("m8", "I'm vegetarian", "user|diet", "vegetarian", T1)
    not_vegan = fact("I'm not vegan anymore", "user|diet", "not:vegan")
    assert consolidate(not_vegan, [vegan]) == Decision("supersede", ("m8",))
    assert consolidate(not_vegan, [vegetarian]) == Decision("add")


def test_clear_rules_quitting_retires_the_employer() -> None:
    got = consolidate(fact("I quit my job", "user|job", "none"), [NURSE, SIEMENS, COFFEE])
    assert got == Decision("supersede", ("m3", "m4"))
    partner = ExistingMemory("m10", "My girlfriend's name is Ana", "girlfriend|name", "ana", T1)
    dating = ExistingMemory("m11", "I have a girlfriend", "user|relationship", "in a relationship", T1)
    got = consolidate(fact("We broke up", "user|relationship", "single"), [partner, dating])
    assert got == Decision("supersede", ("m10", "m11"))


def test_near_duplicates_need_similarity_and_overlap() -> None:
    close = lambda a, b: 0.95  # noqa: E731
    far = lambda a, b: 0.5  # noqa: E731
    trip = fact("I went to Rome back in May")
    assert consolidate(trip, [TRIP]) == Decision("add")  # no similarity given: step skipped
    assert consolidate(trip, [TRIP], close) == Decision("duplicate", ("m5",))
    assert consolidate(trip, [TRIP], far) == Decision("add")
    # high similarity but few shared content words: not a duplicate
    assert consolidate(fact("I went to Bern in June"), [TRIP], close) == Decision("add")
    # never across two values of one slot, however similar
    older = fact("I moved to Berlin", "user|home_city", "berlin", valid_from="2020-01-01T00:00:00Z")
    lisbon_moved = ExistingMemory("m12", "I moved to Lisbon", "user|home_city", "lisbon", T1)
    assert consolidate(older, [lisbon_moved], close) == Decision("outdated", ("m12",))


def test_word_overlap_keeps_negations() -> None:
    assert word_overlap("I live in Berlin now", "I live in Berlin") == 1.0
    assert word_overlap("I like coffee", "I don't like coffee") == pytest.approx(2 / 3)


def test_config_errors_name_the_field() -> None:
    with pytest.raises(
        ValueError, match=r"ConsolidationConfig.near_duplicate_overlap: must be in \[0, 1\], got 1.5"
    ):
        ConsolidationConfig(near_duplicate_overlap=1.5)


def test_batch_later_fact_supersedes_earlier_one_by_order() -> None:
    facts = [
        fact("I live in Porto", "user|home_city", "porto"),
        fact("I love tea", "user|likes:tea", "yes"),
        fact("Actually I live in Braga", "user|home_city", "braga", valid_from=T1),  # older valid_from
        fact("I love tea!", "user|likes:tea", "yes"),
    ]
    got = consolidate_batch(facts, [LISBON, COFFEE])
    assert got == BatchConsolidation(
        decisions=(
            Decision("supersede", ("m1",)),
            Decision("add"),
            Decision("supersede", ("batch:0",)),
            Decision("duplicate", ("batch:1",)),
        ),
        supersessions=(Supersession(0, "m1"), Supersession(2, "batch:0")),
        current=("m2", "batch:1", "batch:2"),
    )


def test_batch_said_at_must_match_the_facts() -> None:
    with pytest.raises(ValueError, match="said_at has 1 times for 2 facts"):
        consolidate_batch([fact("a"), fact("b")], [], said_at=[T2])
