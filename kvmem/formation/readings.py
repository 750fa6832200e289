"""The learned readings of a change (issue 45 item 3): where the rules' slots retire nothing, what the change head
(change_head.py) and the pair encoder (pair_encoder.py) say a new fact retires. The caller
(scheduler/formation_decisions.py) computes the readings, ChangeReading; consolidate.py asks `learned_retirement`
after its own rules. Pure policy over texts and the readings' numbers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from kvmem.formation.change_guard import (
    area_of_slot,
    ends_partnership,
    names_partner,
    other_area,
    partner_named_in_ending,
    same_value,
    tells_change,
)
from kvmem.formation.tastes_told import (
    shares_a_word,
    tells_habit_now,
    tells_new_habit,
    tells_not_mine,
    tells_taste,
)
from kvmem.formation.types import ExistingMemory, Fact, Similarity, is_older


@dataclass(frozen=True)
class ChangeReading:
    """What the learned change head read (change_head.py), by text; the caller computes it. `changed`: a new
    fact's text -> the area it tells a change in (only facts believed to be a change and not blocked by the
    rules' guard, change_guard.blocker); `areas`: any text (memory or fact) -> the area it is about;
    `similarity`: the cosine of two of those texts' memory vectors (a change in the "pref" area retires only a
    memory at least PREF_SIMILARITY close to it; None: no change in that area retires anything); `retires`:
    the probability that a new fact retires a memory (by their texts; 0.0 where the guard blocks the fact),
    believed at `retire_at`; `encoded`: the pair encoder's reading (pair_encoder.py), (a new fact's text, memories'
    texts) -> the probability that the fact retires each (0.0 where the guard blocks the fact), believed at
    `encoded_at`; `told`: the facts of `changed` read as a change from their words alone, not the head's change
    probability (change_guard.tells_change), which retire only a memory at least TOLD_SIMILARITY close."""

    changed: Mapping[str, str]
    areas: Mapping[str, str]
    similarity: Similarity | None = None
    retires: Similarity | None = None
    retire_at: float = 1.0
    encoded: Callable[[str, Sequence[str]], Sequence[float]] | None = None
    encoded_at: float = 1.0
    told: frozenset[str] = frozenset()


def learned_retirement(
    fact: Fact,
    pool: Sequence[ExistingMemory],
    changes: ChangeReading,
    said_at: str | None,
    ordered_ids: frozenset[str],
) -> str | None:
    """The memory of `pool` the readings say `fact` retires, first reading that names one: a fact the head reads as
    a change retires the memory of its area (`changed_memory`); else a taste its pair layer says the fact retires
    (`retired_taste`, not for a fact read as about home, job or partner); else the memory the pair encoder says it
    retires (`encoded_retirement`). None: nothing."""
    target = None
    if fact.text in changes.changed:
        target = changed_memory(fact, pool, changes, said_at, ordered_ids)
    # the pair reading is for tastes: not for a fact read as a change of home, job or partner
    taste = (
        changes.changed.get(fact.text, "pref") == "pref" and changes.areas.get(fact.text, "pref") == "pref"
    )
    if target is None and taste and changes.retires is not None and changes.similarity is not None:
        target = retired_taste(fact, pool, changes, said_at, ordered_ids)
    if target is None and changes.encoded is not None and changes.similarity is not None:
        target = encoded_retirement(fact, pool, changes, said_at, ordered_ids)
    return target


# how close a taste's change must be to the memory it retires (cosine of the default embedder's memory vectors).
# Chosen on the sixth sealed set with the head trained on the first five and REALTALK's tune split: 0.4 / 0.45 /
# 0.5 caught 0.491 / 0.481 / 0.472 of its changes with 3 of 109 false each, and retired 5 / 5 / 4 memories on
# REALTALK's report split (docs/benchmarks.md)
PREF_SIMILARITY = 0.4
# how close a memory must be to a change read from its words alone (ChangeReading.told) to be retired by it: the head's
# area reading is loose on real chat ("I have since found calculus to be very useful" read in the area of "I have
# been running some errands", cosine 0.02). Chosen on the fourth to ninth sealed sets and REALTALK's report split:
# with no floor / 0.2 / 0.25 / 0.3 the words-alone reading retired 20 / 17 / 16 / 15 memories on the report split
# (11 without it), and 11 at 0.3 once words of how long were no longer enough (tells_change's `strict`), most of
# the rest wrong; on the ninth set it catches 0.585 of the changes at 0.3 (0.528 without it) with 0 of 109 false
TOLD_SIMILARITY = 0.3
# the change head's single-valued areas as the rules' slots name them (change_guard.area_of_slot)
_SLOT_AREA = {"home": "user|home_city", "job": "work", "partner": "partner"}


def changed_memory(
    fact: Fact,
    pool: Sequence[ExistingMemory],
    changes: ChangeReading,
    said_at: str | None,
    ordered_ids: frozenset[str],
) -> str | None:
    """The memory a fact the change head reads as a change retires: the latest one about the same area,
    not newer than the fact, that the rules do not read as the fact's own slot and value (a restatement) or
    as another area's (for a break-up, change_guard.ends_partnership, a memory told of the user's partner as theirs
    counts in the "partner" area wherever the head reads it: change_guard.names_partner); in the "pref" area (tastes, habits, pastimes: many at once) the closest of those whose
    memory vector is at least PREF_SIMILARITY close to the fact's ("I gave up coffee" retires "I drink coffee
    every morning", not "I love hiking")."""
    area = changes.changed[fact.text]
    similarity = changes.similarity
    # a change told in words alone needs a close memory, unless the rules read it a slot of the same area ("I've
    # retired": the job)
    told = fact.text in changes.told and (
        fact.slot is None or area_of_slot(fact.slot) != _SLOT_AREA.get(area)
    )
    floor = PREF_SIMILARITY if area == "pref" else TOLD_SIMILARITY if told else None
    partner_ended = area == "partner" and ends_partnership(fact.text)
    # a partner named as the ending's subject retires a memory told of the partner only if it names them ("Rory and
    # I are done": "My partner Rory and I share a flat", not "My wife Ann is a nurse")
    named = partner_named_in_ending(fact.text) if partner_ended else None
    found = [
        m
        for m in pool
        if (changes.areas.get(m.text) == area or (partner_ended and names_partner(m.text, named)))
        and (floor is None or (similarity is not None and similarity(fact.text, m.text) >= floor))
        and may_retire(fact, m, said_at, ordered_ids)
    ]
    if not found:
        return None
    if area == "pref":  # many tastes at once: the one the fact is about, the closest
        assert similarity is not None
        return max(found, key=lambda m: similarity(fact.text, m.text)).id
    # the latest said: a batch's own earlier facts (ordered_ids) were said after every stored memory
    return max(found, key=lambda m: (m.id in ordered_ids, m.said_at or m.valid_from)).id


def retired_taste(
    fact: Fact,
    pool: Sequence[ExistingMemory],
    changes: ChangeReading,
    said_at: str | None,
    ordered_ids: frozenset[str],
) -> str | None:
    """The taste a fact retires by the head's pair reading, where its first reading retires nothing ("I hate
    mushrooms" -> "Mushrooms are my favourite now" tells no change word): of the "pref" memories at least
    PREF_SIMILARITY close to it, not newer than it, and not the rules' same slot and value or another area, the
    one it most probably retires, at `changes.retire_at` or above."""
    retires, similarity = changes.retires, changes.similarity
    if retires is None or similarity is None:
        return None
    scored = [
        (retires(fact.text, m.text), m)
        for m in pool
        if changes.areas.get(m.text) == "pref"
        and similarity(fact.text, m.text) >= PREF_SIMILARITY
        and may_retire(fact, m, said_at, ordered_ids)
    ]
    scored = [(p, m) for p, m in scored if p >= changes.retire_at]
    return max(scored, key=lambda pm: pm[0])[1].id if scored else None


# how many of the memories closest to a fact (by memory vector) the pair encoder reads it against: the worker's
# candidates are its slots' and the nearest by embedding, and a change is told about a memory close to it
ENCODED_CANDIDATES = 5
# and how close one must be at least: a review found "I sold my car." retiring "I play guitar in a band." (cosine
# 0.24; this floor does not stop that one). Chosen on the eighth sealed set with the encoder trained on the first
# seven (docs/benchmarks.md): 0 / 0.15 / 0.2 / 0.25 / 0.3 caught 0.717 / 0.717 / 0.717 / 0.679 / 0.651 of its
# changes at 8 / 8 / 6 / 6 / 6 of 109 false
ENCODED_SIMILARITY = 0.2


def encoded_retirement(
    fact: Fact,
    pool: Sequence[ExistingMemory],
    changes: ChangeReading,
    said_at: str | None,
    ordered_ids: frozenset[str],
) -> str | None:
    """The memory a fact retires by the pair encoder's reading (both texts read together), where the rules and
    the change head's readings retire nothing: of the ENCODED_CANDIDATES memories closest to it that it may retire
    (`may_retire`), at cosine ENCODED_SIMILARITY or more, and tastes (area "pref") only for a fact telling a
    taste (tastes_told.tells_taste) or a change (change_guard.tells_change), the one it most probably
    retires, at `changes.encoded_at` or above."""
    encoded, similarity = changes.encoded, changes.similarity
    if encoded is None or similarity is None:
        return None
    # a taste is retired only by a fact telling a taste or a change ("Uninstalled WoW and cancelled the sub"): the
    # encoder reads a plain mention ("I had mushrooms at dinner", "I'm cooking mushrooms for the kids now") as
    # retiring "I can't stand mushrooms". The changes let in caught 2 -> 7 of the ninth set's 26 changes of taste
    # with no false supersession more (docs/benchmarks.md)
    taste_told = tells_taste(fact.text) or tells_change(fact.text, strict=True)
    # a habit told against another or given up, only against a taste it shares a word with; one taken up, only
    # against a taste told as not the user's (tastes_told)
    habit = not taste_told and tells_habit_now(fact.text)
    new_habit = not taste_told and tells_new_habit(fact.text)

    def weighed(m: ExistingMemory) -> bool:
        return (
            taste_told
            or changes.areas.get(m.text) != "pref"
            or (habit and shares_a_word(fact.text, m.text))
            or (new_habit and tells_not_mine(m.text))
        )

    closeness = {m.id: similarity(fact.text, m.text) for m in pool}  # once a memory
    candidates = [
        m
        for m in pool
        if closeness[m.id] >= ENCODED_SIMILARITY and weighed(m) and may_retire(fact, m, said_at, ordered_ids)
    ]
    candidates = sorted(candidates, key=lambda m: -closeness[m.id])[:ENCODED_CANDIDATES]
    if not candidates:
        return None
    probabilities = encoded(fact.text, [m.text for m in candidates])
    best = max(range(len(candidates)), key=lambda i: probabilities[i])
    return candidates[best].id if probabilities[best] >= changes.encoded_at else None


def may_retire(fact: Fact, memory: ExistingMemory, said_at: str | None, ordered_ids: frozenset[str]) -> bool:
    """Whether the change head's reading may retire `memory` by `fact`: not a memory newer than the fact (a
    batch's own earlier facts, `ordered_ids`, are older), nor one the rules read as the fact's own slot and value
    (a restatement) or as another area's."""
    return (
        (memory.id in ordered_ids or not is_older(fact, said_at, memory))
        and not same_value(fact.text, memory.text)
        and not other_area(fact.text, memory.text)
    )
