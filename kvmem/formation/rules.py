"""`RuleExtractor` ("rules"): atomic facts from the user's turns with no LLM: statements (`clauses.py`),
relative dates resolved against the turn's time (`dates.py`), and the slot each one sets (`slots.py`).

Composes those three; knows nothing of the store, consolidation or speakers (a multi-party turn's text is
taken as its speaker's own first-person statements, and the caller keeps who the speaker was).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from datetime import date

from kvmem.formation.atoms import atoms
from kvmem.formation.clause_subject import strip_adverbials, strip_markers, subject_core
from kvmem.formation.clauses import split_sentences, statements
from kvmem.formation.dates import DateResolution, is_past_tense, iso_time, parse_chat_time, resolve_dates
from kvmem.formation.slots import SlotMatch, match_slot
from kvmem.formation.types import Fact, TurnInput

_PREFERENCE = re.compile(
    r"\b(?:love|like|enjoy|hate|dislike|prefer|adore|can't stand|favou?rite|into|fan of|obsessed with)\b",
    re.I,
)
_PLAN = re.compile(
    r"\b(?:going to|gonna|will|'ll|plan(?:ning)? to|about to|intend to|hoping to|thinking (?:about|of))\b",
    re.I,
)
_RELATION = re.compile(
    r"^(?:my|our) (?:\w+ )?(?:mom|mum|mother|dad|father|sister|brother|wife|husband|partner|boyfriend|"
    r"girlfriend|son|daughter|kids?|children|parents|family|friend|best friend|grand\w+|aunt|uncle|cousin|"
    r"fianc\w+)\b",
    re.I,
)
_USED_TO = re.compile(r"\bused to\b", re.I)


def _kind(core: str, resolved: DateResolution, today: date, slot: SlotMatch | None) -> str:
    """A slot's own kind; otherwise plan (a future date or "going to"), preference, event (past tense, not
    a habit: "I used to ..." is a fact), relation or fact, in that order."""
    if slot is not None:
        return slot.kind
    if any(d.start > today for d in resolved.dates) or _PLAN.search(core):
        return "plan"
    if _PREFERENCE.search(core):
        return "preference"
    if is_past_tense(core) and not _USED_TO.search(core):
        return "event"
    if _RELATION.match(core):
        return "relation"
    return "fact"


def _valid_from(resolved: DateResolution, chat_time: str) -> str:
    """The day a past event names (its first day: "last week" -> that Monday); otherwise the turn's time.
    A date on or after the turn's day gives the turn's time: a plan is known from when it is said, and a
    same-day event must not look older than what the user said earlier that day."""
    event = resolved.event_date
    if event is not None and event < parse_chat_time(chat_time).date():
        return iso_time(event)
    return chat_time


def sentence_case(text: str) -> str:
    return text[:1].upper() + text[1:] if text else text


def slot_of(text: str) -> tuple[str, str] | None:
    """The (slot, value) a memory's text sets, for a memory added directly rather than formed: the first
    sentence or clause that sets one ("My dog is called Rex." -> ("user|dog.name", "rex")), else None."""
    for sentence in split_sentences(text):
        clause = strip_markers(sentence.rstrip(" .!?"))
        core = subject_core(clause) or strip_adverbials(clause)
        found = match_slot(core)
        if found is not None:
            return found.slot, found.value
    return None


class RuleExtractor:
    """Facts from user turns by general English patterns; no model, deterministic, thread-safe.

    Each kept clause becomes one fact per atomic statement in it (`atoms.py`): its text as said with relative dates resolved, its slot and value
    where it sets a known attribute, `valid_from` the past day it names or the turn's time. Turns whose
    role is not "user" yield nothing; a clause repeated within one turn yields one fact.
    """

    name = "rules"

    def extract(self, turns: Sequence[TurnInput]) -> list[Fact]:
        facts: list[Fact] = []
        for turn in turns:
            if turn.role != "user" or not turn.text:
                continue
            today = parse_chat_time(turn.chat_time).date()
            seen: set[str] = set()
            for clause in statements(turn.text):
                resolved = resolve_dates(clause.text, turn.chat_time)
                for atom in atoms(resolved.text):  # a compound statement: one fact each
                    text = sentence_case(atom)
                    if text.lower() in seen:
                        continue
                    seen.add(text.lower())
                    core = subject_core(text) or strip_adverbials(text)
                    slot = match_slot(core)
                    facts.append(
                        Fact(
                            text=text,
                            turn_ids=(turn.id,),
                            valid_from=_valid_from(resolved, turn.chat_time),
                            kind=_kind(core, resolved, today, slot),
                            slot=slot.slot if slot else None,
                            value=slot.value if slot else None,
                        )
                    )
        return facts
