"""The shapes memory formation hands across module boundaries: a log turn as an extractor reads it, a formed
fact, and a consolidation decision.

Knows nothing of SQLite, HTTP or how facts are extracted.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

from kvmem.formation.dates import parse_chat_time

DECISIONS = ("add", "duplicate", "supersede", "outdated")


@dataclass(frozen=True)
class TurnInput:
    """One conversation-log turn, as an extractor reads it."""

    id: str
    role: str  # "user" | "assistant" | "system" (a multi-party log: the speaker's name is in `speaker`)
    text: str
    chat_time: str  # ISO 8601 UTC, e.g. "2026-11-26T14:41:09.000000Z"
    session_id: str | None = None
    speaker: str | None = None  # a name when the log names one (imports); None: the user themselves


@dataclass(frozen=True)
class Fact:
    """One atomic memory formed from one or more turns.

    `text` is self-contained and as the user said it (first person kept), with relative dates resolved
    ("yesterday" -> "on 2026-11-25"). `slot` names the subject and attribute the fact sets
    ("user|home_city", "user|dog.name", "user|likes:coffee"), `value` its normalized value ("berlin"); a fact
    with no slot never supersedes anything. `valid_from` is when it became true as far as we know (the turn's
    time, or the resolved date it names).
    """

    text: str
    turn_ids: tuple[str, ...]
    valid_from: str
    kind: str = "fact"  # "fact" | "preference" | "plan" | "relation" | "event"
    slot: str | None = None
    value: str | None = None


@dataclass(frozen=True)
class Decision:
    """What consolidation does with a new fact: add it; drop it as a duplicate of `target_ids` (their
    provenance gains its turns); add it and supersede `target_ids` (they get valid_to and superseded_by); or
    add it already superseded by `target_ids[0]` ("outdated": a newer memory sets its slot otherwise, so it is
    history, never served)."""

    kind: str  # one of DECISIONS
    target_ids: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        assert self.kind in DECISIONS, self.kind
        assert (self.kind == "add") == (not self.target_ids), (self.kind, self.target_ids)


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


def _time(value: str) -> datetime | None:
    try:
        return parse_chat_time(value) if value else None
    except ValueError:
        return None


def is_older(fact: Fact, fact_said_at: str | None, memory: ExistingMemory) -> bool:
    """Whether the fact is older than the memory: by when each was said where both times are known (a past
    event told later, "I moved to Porto last year", is news), else by valid_from."""
    if fact_said_at and memory.said_at:
        fact_time, memory_time = _time(fact_said_at), _time(memory.said_at)
    else:
        fact_time, memory_time = _time(fact.valid_from), _time(memory.valid_from)
    return fact_time is not None and memory_time is not None and fact_time < memory_time
