"""What to do with a newly formed fact given the current memories: add it, drop it as a duplicate, or add it
and supersede the memories it contradicts ("I moved to Berlin" retires "I live in Lisbon").

Pure policy over texts, slots, values and times; the embedding similarity is the caller's function. Knows
nothing of the store: it returns decisions, the caller writes them.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime

from kvmem.formation.change_guard import area_of_slot, other_area, same_value, tells_change, tells_taste
from kvmem.formation.dates import parse_chat_time
from kvmem.formation.types import Decision, Fact

Similarity = Callable[[str, str], float]


@dataclass(frozen=True)
class ExistingMemory:
    """A current memory as consolidation sees it. `valid_from` is an ISO 8601 time; "" where unknown (then
    it is never newer than a fact). `said_at`: when the user last stated it (its latest turn's chat_time),
    "" where unknown; see `consolidate` for what it changes."""

    id: str
    text: str
    slot: str | None = None
    value: str | None = None
    valid_from: str = ""
    said_at: str = ""


@dataclass(frozen=True)
class ClearRule:
    """A fact setting `slot` to one of `values` also retires memories whose slot starts with one of
    `clears`: quitting a job retires the employer, becoming single retires the partner's details."""

    slot: str
    values: tuple[str, ...]
    clears: tuple[str, ...]


_PARTNERS = ("girlfriend|", "boyfriend|", "partner|", "fiance|", "wife|", "husband|")
DEFAULT_CLEARS = (
    ClearRule("user|job", ("none", "retired"), ("user|employer",)),
    ClearRule("user|relationship", ("single", "divorced", "separated", "widowed"), _PARTNERS),
    # getting engaged or married: a boyfriend or girlfriend is one no longer (a fiance, once married)
    ClearRule("user|relationship", ("engaged", "married"), ("girlfriend|", "boyfriend|")),
    ClearRule("user|relationship", ("married",), ("fiance|",)),
)
# "user|only:<verb>" = X ("I only drink tea"): retires every other liked thing the user said they <verb> (in
# serving, among the memories the formation pass considers: its slot's and the nearest by embedding)
ONLY_PREFIX = "user|only:"

_VERB_FORMS = {"drink": ("drink", "drinks", "drinking", "drank"), "eat": ("eat", "eats", "eating", "ate")}


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


@dataclass(frozen=True)
class ConsolidationConfig:
    """Thresholds of the near-duplicate test, which needs both: an embedding cosine of at least
    `near_duplicate_similarity` (0.92: only close paraphrases of one statement; sentence embedders also score
    "I live in Berlin" against "I live in Bern" high, which is why the second test exists), and a Jaccard
    overlap of content words of at least `near_duplicate_overlap` (0.5: a paraphrase keeps most content
    words; a statement about another object or value shares few). Neither threshold is fitted to data here."""

    near_duplicate_similarity: float = 0.92
    near_duplicate_overlap: float = 0.5
    clears: tuple[ClearRule, ...] = field(default=DEFAULT_CLEARS)

    def __post_init__(self) -> None:
        for name in ("near_duplicate_similarity", "near_duplicate_overlap"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"ConsolidationConfig.{name}: must be in [0, 1], got {value!r}")


DEFAULT_CONFIG = ConsolidationConfig()

# ---- text comparison -------------------------------------------------------------------------------------

_TOKEN = re.compile(r"[a-z0-9@][a-z0-9@.'+-]*[a-z0-9]|[a-z0-9]")
_PUNCT = re.compile(r"[^\w@+]+")
# Function words; negations ("not", "don't", "no", "never", "anymore") are content, so "I like coffee" and
# "I don't like coffee" do not overlap fully.
_STOPWORDS = frozenset(
    """
    i i'm i've i'd i'll me my mine myself we we're we've our ours us a an the this that these those to of in on
    at for with and but or so as by from is am are was were be been being it it's its just really very
    now currently also still actually then there here do does did have has had
    """.split()
)


def normalized_text(text: str) -> str:
    """Lowercase words only: "I live in Berlin!" and "i live in berlin" are the same text."""
    return " ".join(_PUNCT.sub(" ", text.lower()).split())


def content_words(text: str) -> frozenset[str]:
    return frozenset(w for w in _TOKEN.findall(text.lower()) if w not in _STOPWORDS)


def word_overlap(a: str, b: str) -> float:
    """Jaccard overlap of the content words of two texts; 1.0 for two texts with none."""
    wa, wb = content_words(a), content_words(b)
    return len(wa & wb) / len(wa | wb) if wa or wb else 1.0


def _time(value: str) -> datetime | None:
    try:
        return parse_chat_time(value) if value else None
    except ValueError:
        return None


# ---- single fact -------------------------------------------------------------------------------------------


def _contradicts(fact: Fact, memory: ExistingMemory, config: ConsolidationConfig) -> bool:
    """Whether `fact` states a different value of `memory`'s slot (or clears it). A negated value,
    "not:vegan", contradicts only that value."""
    assert fact.slot is not None and fact.value is not None
    if memory.slot == fact.slot and memory.value != fact.value:
        if fact.value.startswith("not:"):
            return _same_name(memory.value, fact.value[4:])
        return True
    if (
        fact.slot.startswith(ONLY_PREFIX)
        and memory.slot is not None
        and memory.slot.startswith("user|likes:")
    ):
        verb = fact.slot[len(ONLY_PREFIX) :]
        forms = _VERB_FORMS.get(verb, (verb, f"{verb}s", f"{verb}es", f"{verb}ing"))
        words = set(normalized_text(memory.text).split())
        return (
            memory.value == "yes"
            and memory.slot != f"user|likes:{fact.value}"
            and any(f in words for f in forms)
        )
    return any(
        rule.slot == fact.slot
        and fact.value in rule.values
        and memory.slot is not None
        and memory.slot.startswith(rule.clears)
        for rule in config.clears
    )


def _same_name(value: str | None, named: str) -> bool:
    """Whether a negated value names `value`: equal, or one the other's leading words ("I no longer work at
    the Odeon" names "odeon cinema")."""
    if value is None:
        return False
    return value == named or value.startswith(f"{named} ") or named.startswith(f"{value} ")


def _is_older(fact: Fact, fact_said_at: str | None, memory: ExistingMemory) -> bool:
    """Whether the fact is older than the memory: by when each was said where both times are known (a past
    event told later, "I moved to Porto last year", is news), else by valid_from."""
    if fact_said_at and memory.said_at:
        fact_time, memory_time = _time(fact_said_at), _time(memory.said_at)
    else:
        fact_time, memory_time = _time(fact.valid_from), _time(memory.valid_from)
    return fact_time is not None and memory_time is not None and fact_time < memory_time


def _decide(
    fact: Fact,
    pool: Sequence[ExistingMemory],
    similarity: Similarity | None,
    config: ConsolidationConfig,
    said_at: str | None = None,
    ordered_ids: frozenset[str] = frozenset(),
    changes: ChangeReading | None = None,
    same_turn: frozenset[str] = frozenset(),
) -> Decision:
    """`consolidate`; a memory in `ordered_ids` was stated before `fact` in the same batch, so the fact
    supersedes it whatever their times say; one in `same_turn` was formed from the fact's own turn (the change
    head never retires it: "We've packed up" and "moved down to Hobart" tell one move)."""
    key = normalized_text(fact.text)
    duplicates = [m.id for m in pool if normalized_text(m.text) == key]
    if fact.slot is not None and fact.value is not None:
        duplicates += [
            m.id for m in pool if m.slot == fact.slot and m.value == fact.value and m.id not in duplicates
        ]
    if duplicates:
        return Decision("duplicate", tuple(duplicates))
    if fact.slot is not None and fact.value is not None:
        targets = [
            m.id
            for m in pool
            if _contradicts(fact, m, config) and (m.id in ordered_ids or not _is_older(fact, said_at, m))
        ]
        if targets:
            return Decision("supersede", tuple(targets))
        newer = [
            m
            for m in pool
            if m.slot == fact.slot and _contradicts(fact, m, config) and m.id not in ordered_ids
        ]
        if newer:  # every one of them is newer (else it would be a target): the fact is history already
            return Decision("outdated", (max(newer, key=lambda m: m.said_at or m.valid_from).id,))
    if similarity is not None:
        near = [
            m.id
            for m in pool
            if not (fact.slot and m.slot and (fact.slot, fact.value) != (m.slot, m.value))
            and word_overlap(fact.text, m.text) >= config.near_duplicate_overlap
            and similarity(fact.text, m.text) >= config.near_duplicate_similarity
        ]
        if near:
            return Decision("duplicate", tuple(near))
    # the change head after the near-duplicates: a restatement of a memory retires nothing
    if changes is not None:
        others = [m for m in pool if m.id not in same_turn]
        target = None
        if fact.text in changes.changed:
            target = _changed_memory(fact, others, changes, said_at, ordered_ids)
        # the pair reading is for tastes: not for a fact read as a change of home, job or partner
        taste = (
            changes.changed.get(fact.text, "pref") == "pref"
            and changes.areas.get(fact.text, "pref") == "pref"
        )
        if target is None and taste and changes.retires is not None and changes.similarity is not None:
            target = _retired_taste(fact, others, changes, said_at, ordered_ids)
        if target is None and changes.encoded is not None and changes.similarity is not None:
            target = _encoded_retirement(fact, others, changes, said_at, ordered_ids)
        if target is not None:
            return Decision("supersede", (target,))
    return Decision("add")


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


def _changed_memory(
    fact: Fact,
    pool: Sequence[ExistingMemory],
    changes: ChangeReading,
    said_at: str | None,
    ordered_ids: frozenset[str],
) -> str | None:
    """The memory a fact the change head reads as a change retires: the latest one about the same area,
    not newer than the fact, that the rules do not read as the fact's own slot and value (a restatement) or
    as another area's; in the "pref" area (tastes, habits, pastimes: many at once) the closest of those whose
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
    found = [
        m
        for m in pool
        if changes.areas.get(m.text) == area
        and (floor is None or (similarity is not None and similarity(fact.text, m.text) >= floor))
        and _may_retire(fact, m, said_at, ordered_ids)
    ]
    if not found:
        return None
    if area == "pref":  # many tastes at once: the one the fact is about, the closest
        assert similarity is not None
        return max(found, key=lambda m: similarity(fact.text, m.text)).id
    # the latest said: a batch's own earlier facts (ordered_ids) were said after every stored memory
    return max(found, key=lambda m: (m.id in ordered_ids, m.said_at or m.valid_from)).id


def _retired_taste(
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
        and _may_retire(fact, m, said_at, ordered_ids)
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


def _encoded_retirement(
    fact: Fact,
    pool: Sequence[ExistingMemory],
    changes: ChangeReading,
    said_at: str | None,
    ordered_ids: frozenset[str],
) -> str | None:
    """The memory a fact retires by the pair encoder's reading (both texts read together), where the rules and
    the change head's readings retire nothing: of the ENCODED_CANDIDATES memories closest to it that it may retire
    (`_may_retire`), at cosine ENCODED_SIMILARITY or more, and tastes (area "pref") only for a fact telling a
    taste (change_guard.tells_taste) or a change (change_guard.tells_change), the one it most probably
    retires, at `changes.encoded_at` or above."""
    encoded, similarity = changes.encoded, changes.similarity
    if encoded is None or similarity is None:
        return None
    # a taste is retired only by a fact telling a taste or a change ("Uninstalled WoW and cancelled the sub"): the
    # encoder reads a plain mention ("I had mushrooms at dinner", "I'm cooking mushrooms for the kids now") as
    # retiring "I can't stand mushrooms". The changes let in caught 2 -> 7 of the ninth set's 26 changes of taste
    # with no false supersession more (docs/benchmarks.md)
    taste_told = tells_taste(fact.text) or tells_change(fact.text, strict=True)
    closeness = {m.id: similarity(fact.text, m.text) for m in pool}  # once a memory
    candidates = [
        m
        for m in pool
        if closeness[m.id] >= ENCODED_SIMILARITY
        and (taste_told or changes.areas.get(m.text) != "pref")
        and _may_retire(fact, m, said_at, ordered_ids)
    ]
    candidates = sorted(candidates, key=lambda m: -closeness[m.id])[:ENCODED_CANDIDATES]
    if not candidates:
        return None
    probabilities = encoded(fact.text, [m.text for m in candidates])
    best = max(range(len(candidates)), key=lambda i: probabilities[i])
    return candidates[best].id if probabilities[best] >= changes.encoded_at else None


def _may_retire(fact: Fact, memory: ExistingMemory, said_at: str | None, ordered_ids: frozenset[str]) -> bool:
    """Whether the change head's reading may retire `memory` by `fact`: not a memory newer than the fact (a
    batch's own earlier facts, `ordered_ids`, are older), nor one the rules read as the fact's own slot and value
    (a restatement) or as another area's."""
    return (
        (memory.id in ordered_ids or not _is_older(fact, said_at, memory))
        and not same_value(fact.text, memory.text)
        and not other_area(fact.text, memory.text)
    )


def consolidate(
    fact: Fact,
    existing: Sequence[ExistingMemory],
    similarity: Similarity | None = None,
    config: ConsolidationConfig = DEFAULT_CONFIG,
    said_at: str | None = None,
    changes: ChangeReading | None = None,
) -> Decision:
    """The decision for one new fact against the current memories, first rule that applies:

    1. "duplicate" of every memory with the same normalized text, or the same slot and value;
    2. "supersede" every memory with the same slot and another value (or cleared by a `ClearRule`) that is
       not newer than the fact; else "outdated" when memories with the same slot and another value are all
       newer than the fact (a backlog fact, e.g. from an imported old log, or a turn formed late): it is added
       already superseded by the newest of them, so a single-valued slot never has two current values. A
       fact without a slot never supersedes. "Newer" compares `said_at` (when the fact was said: its latest
       turn's chat_time) with the memory's `said_at` where both are given, else the two `valid_from`: a
       fact's valid_from may be the past day it names ("I moved to Porto last year" -> that year's first
       day), which can precede a memory said before it ("I live in Lisbon"), so pass `said_at` where known;
    3. "duplicate" of every memory that is a near-duplicate: `similarity` (an embedding cosine the caller
       supplies; step skipped when None) and content-word overlap both at or above the config's thresholds,
       never across two different values of one slot;
    4. "add".
    Between 3 and 4, with `changes` (the learned change head's reading, ChangeReading): a fact it reads as a
    change that rules 1-3 left alone supersedes one memory, `_changed_memory`; where that retires nothing, a
    taste its pair reading says the fact retires, `_retired_taste`; where that retires nothing, the memory the
    pair encoder says it retires, `_encoded_retirement`.
    """
    return _decide(fact, existing, similarity, config, said_at, changes=changes)


# ---- a batch of facts --------------------------------------------------------------------------------------

BATCH_REF_PREFIX = "batch:"


def batch_ref(index: int) -> str:
    """The id a batch decision uses for the `index`-th new fact of the batch, until the caller stores it."""
    return f"{BATCH_REF_PREFIX}{index}"


@dataclass(frozen=True)
class Supersession:
    """New fact `new_index` of the batch retires `old_id`: an existing memory's id or `batch_ref(j)`."""

    new_index: int
    old_id: str


@dataclass(frozen=True)
class BatchConsolidation:
    """Decisions for a batch, one per fact in order (targets are existing ids or `batch_ref(j)` of an earlier
    fact of the batch), every supersession they make, and the ids current afterwards: existing memories not
    retired, then `batch_ref(i)` of each new fact added and not retired within the batch."""

    decisions: tuple[Decision, ...]
    supersessions: tuple[Supersession, ...]
    current: tuple[str, ...]


def consolidate_batch(
    facts: Sequence[Fact],
    existing: Sequence[ExistingMemory],
    similarity: Similarity | None = None,
    config: ConsolidationConfig = DEFAULT_CONFIG,
    said_at: Sequence[str] | None = None,
    changes: ChangeReading | None = None,
) -> BatchConsolidation:
    """`consolidate` each fact in order against the existing memories and the batch's earlier facts. A later
    fact supersedes an earlier one of the same batch by order alone (it was said later), and an existing
    memory as in `consolidate` (`said_at`, one per fact, where known; `changes`, the change head's reading).
    A duplicate adds nothing to the pool."""
    assert not any(m.id.startswith(BATCH_REF_PREFIX) for m in existing), "existing ids clash with batch refs"
    if said_at is not None and len(said_at) != len(facts):
        raise ValueError(f"consolidate_batch: said_at has {len(said_at)} times for {len(facts)} facts")
    pool: list[ExistingMemory] = list(existing)
    batch_ids: set[str] = set()
    decisions: list[Decision] = []
    supersessions: list[Supersession] = []
    for index, fact in enumerate(facts):
        fact_said_at = said_at[index] if said_at is not None else None
        own = frozenset(batch_ref(j) for j in range(index) if set(facts[j].turn_ids) & set(fact.turn_ids))
        decision = _decide(fact, pool, similarity, config, fact_said_at, frozenset(batch_ids), changes, own)
        decisions.append(decision)
        if decision.kind in ("duplicate", "outdated"):  # an outdated fact is not current: not in the pool
            continue
        if decision.kind == "supersede":
            retired = set(decision.target_ids)
            pool = [m for m in pool if m.id not in retired]
            supersessions.extend(Supersession(index, old) for old in decision.target_ids)
        ref = batch_ref(index)
        pool.append(
            ExistingMemory(ref, fact.text, fact.slot, fact.value, fact.valid_from, fact_said_at or "")
        )
        batch_ids.add(ref)
    return BatchConsolidation(tuple(decisions), tuple(supersessions), tuple(m.id for m in pool))
