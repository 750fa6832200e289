"""What to do with a newly formed fact given the current memories: add it, drop it as a duplicate, or add it
and supersede the memories it contradicts ("I moved to Berlin" retires "I live in Lisbon").

Pure policy over texts, slots, values and times; the embedding similarity is the caller's function. Knows
nothing of the store: it returns decisions, the caller writes them.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvmem.formation.readings import ChangeReading, learned_retirement
from kvmem.formation.types import Decision, ExistingMemory, Fact, Similarity, is_older


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
            if _contradicts(fact, m, config) and (m.id in ordered_ids or not is_older(fact, said_at, m))
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
        target = learned_retirement(
            fact, [m for m in pool if m.id not in same_turn], changes, said_at, ordered_ids
        )
        if target is not None:
            return Decision("supersede", (target,))
    return Decision("add")


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
    change that rules 1-3 left alone supersedes one memory, `readings.changed_memory`; where that retires nothing, a
    taste its pair reading says the fact retires, `readings.retired_taste`; where that retires nothing, the memory the
    pair encoder says it retires, `readings.encoded_retirement`.
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
