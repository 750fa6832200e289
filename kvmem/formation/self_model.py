"""`ModelExtractor` ("self"): memories formed by the served model itself, its replies constrained by JSON
schemas, and the updates decided as mem0 does (add, update, delete or nothing, per candidate fact).

1. Extraction: the chat log (as the openai extractor writes it, llm.py) goes to `generate` with the facts
   schema as its response format, greedy; the reply is JSON valid under the schema by construction (the
   engine masks its tokens), so a reply that does not parse is one cut by `max_tokens`; a reply that ends
   with "length" is refused even where it parses (the engine closes a reply that runs into `max_tokens`, so
   its last fact can be cut short: serving/engine/grammar.py). Either is a permanent ExtractionError, kind
   "length": the worker bisects the batch. The rules stay as guards: only user turns
   in which the rules find a statement (kvmem.formation.clauses.statements: no chit-chat, question, request
   to the assistant or hypothetical) are sent as the user's lines (the others as context, and a batch with
   none is not sent at all); relative dates are resolved against the turn's time (llm.py's `_fact`); each
   fact the model writes is split into the rules' statements in it (`atomic`: one memory, one fact); the
   assistant's lines are never memories.
2. Updates: for each candidate fact, the few most similar current memories (the store's dense search) are
   shown to the model, numbered, with the fact, and it answers {"event": add|update|delete|none,
   "memory": the number it names or null} under a schema whose numbers are only those shown. Applied
   exactly (`apply_updates`): add stores the fact; update stores it superseding the named memory; delete
   retires the named memory, superseded by the fact, stored as the event that ended it (kind "event": "I
   sold my car" is itself worth remembering, and nothing is lost: a superseded memory stays in the history);
   none adds the fact's turns to the named memory (a restatement), or nothing when none is named. An
   update or delete naming no memory is an add.
3. The rules guard the updates (change_guard.py): an update or delete stands only where the clause the
   fact came from reads as the user's own change of state; one that reads as another person's, a negated
   change, a plan, a restatement, an addition or a clause with no word of change is the fact added beside the
   memory (a restatement: joined to the memory the model named, as "none"; so is a fact whose slot and value,
   as the rules read them, are the memory's own: change_guard.same_value). An update or delete whose fact sets a slot of another area
   than the memory it names (change_guard.other_area: a new job naming where the user lives) names instead
   the first memory shown of the fact's area ("other slot, retargeted"), or is an add ("other slot").
   `guarded` counts them by reason.

`generate(messages, schema, max_tokens) -> (text, finish_reason)` is the served model (serving/background/
self_generate.py builds it over the engine, at low priority); this module knows nothing of serving.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from kvmem.formation.atoms import atoms
from kvmem.formation.change_guard import other_area, same_value, slot_area, turn_blocker
from kvmem.formation.clauses import statements
from kvmem.formation.errors import ExtractionError
from kvmem.formation.llm import RESPONSE_FORMAT, OpenAIExtractor
from kvmem.formation.rules import sentence_case
from kvmem.formation.types import Fact, TurnInput

log = logging.getLogger(__name__)

Generate = Callable[[list[dict], dict, int], tuple[str, str]]


_TEXT_MAX = 100  # a fact's text in FACTS_SCHEMA, characters
# The bound stops a string where the next word's token no longer fits, so a cut text ends a few characters short of
# it ("... She gives some", 98 characters): near the bound, a text with no end punctuation was cut. 12 characters
# is a long word's token with its space (" recommendation").
_CUT_MARGIN = 12
_ENDS = (".", "!", "?", '"', "'", ")", "\u2026")


def _bounded(schema: dict) -> dict:
    """The openai extractor's facts schema with bounds a small model cannot loop past (it writes until
    max_tokens otherwise: the default 135M model, unbounded, repeated its first fact until 512 tokens): at
    most 3 facts, a fact's text at most 100 characters, its slot parts and date at most 24; at ~3.5 characters
    a token that is ~230 tokens, within the extraction's 512. At least one fact: the model is asked only for
    turns the rules' guard found a statement in (ModelExtractor.extract), and whether a turn holds a fact is
    the guard's call; left free, the demo model (Qwen2.5-Coder-0.5B) answered {"facts": []} greedily for every
    turn, and `self` formed nothing."""
    item = schema["properties"]["facts"]["items"]
    props = {
        k: {**v, "maxLength": _TEXT_MAX if k == "text" else 24} if k != "kind" else v
        for k, v in item["properties"].items()
    }
    facts = {
        **schema["properties"]["facts"],
        "items": {**item, "properties": props},
        "minItems": 1,
        "maxItems": 3,
    }
    return {**schema, "properties": {"facts": facts}}


FACTS_SCHEMA = _bounded(RESPONSE_FORMAT["json_schema"]["schema"])
EVENTS = ("add", "update", "delete", "none")
UPDATE_INSTRUCTIONS = """You keep a user's long-term memories up to date.
You get the memories that are most like a new fact, numbered, and the new fact. Answer with one event:
- "add": the fact is new information (no memory says it);
- "update": the fact replaces a memory (the same thing, now different: a new job, city, partner, taste);
  name that memory;
- "delete": the fact says a memory is no longer true and gives nothing new in its place; name it;
- "none": a memory already says the fact; name it.
Answer with JSON only: {"event": ..., "memory": the memory's number or null}."""


def update_schema(num_memories: int) -> dict:
    """The decision's schema: an event, and a memory number among those shown (or null)."""
    return {
        "type": "object",
        "properties": {
            "event": {"enum": list(EVENTS)},
            "memory": {"enum": [*range(num_memories), None]},
        },
        "required": ["event", "memory"],
        "additionalProperties": False,
    }


@dataclass(frozen=True)
class UpdateDecision:
    """What one candidate fact does: `event` in EVENTS, `target` the id of the memory it names (or None)."""

    event: str
    target: str | None = None


def parse_decision(reply: str, candidate_ids: Sequence[str]) -> UpdateDecision:
    """The model's decision as an UpdateDecision. Raises ValueError for a reply outside the schema."""
    data = json.loads(reply)
    event, number = data["event"], data["memory"]
    if event not in EVENTS or not (
        number is None or (isinstance(number, int) and 0 <= number < len(candidate_ids))
    ):
        raise ValueError(f"a decision outside the schema: {reply!r}")
    return UpdateDecision(event, None if number is None else candidate_ids[number])


def apply_updates(
    facts: Sequence[Fact], decisions: Sequence[UpdateDecision], said_at: Sequence[str]
) -> tuple[list[Any], list[tuple[str, tuple[str, ...]]], list[tuple[str | int, int]], list[tuple[int, str]]]:
    """commit_formed's adds, duplicates, supersessions and outdated for the facts and their decisions (see
    the module docstring); `said_at[i]`: when fact i was said. A memory named by two decisions is superseded
    by the first (commit_formed's rule)."""
    from kvmem.text.records import FormedMemory

    adds: list[Any] = []
    duplicates: list[tuple[str, tuple[str, ...]]] = []
    supersessions: list[tuple[str | int, int]] = []
    for fact, decision, said in zip(facts, decisions, said_at, strict=True):
        if decision.event == "none":
            if decision.target is not None:
                duplicates.append((decision.target, fact.turn_ids))
            continue
        kind = "event" if decision.event == "delete" and decision.target is not None else fact.kind
        text = fact.text.strip()
        adds.append(
            FormedMemory(
                text=text if not text or text[-1] in ".!?" else text + ".",
                source_turn_ids=fact.turn_ids,
                valid_from=fact.valid_from,
                chat_time=said or fact.valid_from,
                slot=fact.slot,
                slot_value=fact.value,
                kind=kind,
            )
        )
        if decision.event in ("update", "delete") and decision.target is not None:
            supersessions.append((decision.target, len(adds) - 1))
    return adds, duplicates, supersessions, []


class ModelExtractor:
    """Facts, and their updates, from the served model (see the module docstring). Thread-safe as
    `generate` is."""

    name = "self"

    def __init__(
        self,
        generate: Generate,
        *,
        max_tokens: int = 512,
        num_candidates: int = 3,
        decide_max_tokens: int = 16,
    ) -> None:
        if max_tokens < 1 or num_candidates < 1 or decide_max_tokens < 1:
            raise ValueError("ModelExtractor: max_tokens, num_candidates and decide_max_tokens must be >= 1")
        self._generate, self.max_tokens, self.num_candidates = generate, max_tokens, num_candidates
        self.decide_max_tokens = decide_max_tokens
        self._format = OpenAIExtractor("http://self", "self")  # its prompt and its reply's reading only
        # the user's words of the turns facts came from, for the guard over updates (turn id -> text;
        # the oldest dropped past _SAID_MAX: a fact whose turn is gone keeps the model's decision)
        self._said: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()
        self.guarded: Counter[str] = Counter()  # updates and deletes the guard turned, by reason

    def extract(self, turns: Sequence[TurnInput]) -> list[Fact]:
        stated = [t for t in turns if t.role == "user" and t.text.strip() and statements(t.text)]
        if not stated:  # chit-chat, questions, requests: the rules' guard, no model call
            return []
        kept = {t.id for t in stated}
        with self._lock:
            for t in stated:
                self._said[t.id] = t.text
                self._said.move_to_end(t.id)
            while len(self._said) > _SAID_MAX:
                self._said.popitem(last=False)
        # a user line the rules find no statement in is context, as the assistant's lines are
        shown = [t if t.role != "user" or t.id in kept else _as_context(t) for t in turns]
        messages = self._format.request_body(shown)["messages"]
        text, finish = self._generate(messages, FACTS_SCHEMA, self.max_tokens)
        try:
            if finish == "length":  # cut, or closed by the engine to fit (its last fact may be cut short)
                raise ValueError(finish)
            items = json.loads(text)["facts"]
        except (ValueError, KeyError, TypeError):
            raise ExtractionError(
                f"self extractor: the reply ended ({finish}) before its JSON did",
                transient=False,
                kind="length",
            ) from None
        turn_ids = tuple(t.id for t in stated)
        facts: dict[str, Fact] = {}
        for item in items:
            fact = OpenAIExtractor._fact(item, turn_ids, stated[-1].chat_time)
            if fact is None:
                continue
            for atom in atomic(fact, cut=was_cut(item["text"])):
                facts.setdefault(" ".join(atom.text.lower().split()), atom)
        return list(facts.values())

    def decide_one(self, fact: Fact, candidates: Sequence[tuple[str, str]]) -> UpdateDecision:
        """The model's event for `fact` given the current memories (id, text) most like it."""
        if not candidates:
            return UpdateDecision("add")
        listed = "\n".join(f"{i}. {text}" for i, (_, text) in enumerate(candidates))
        messages = [
            {"role": "system", "content": UPDATE_INSTRUCTIONS},
            {"role": "user", "content": f"Memories:\n{listed}\nNew fact: {fact.text}"},
        ]
        text, finish = self._generate(messages, update_schema(len(candidates)), self.decide_max_tokens)
        try:
            if finish == "length":  # cut, or closed by the engine to fit: not the model's own decision
                raise ValueError(finish)
            return parse_decision(text, [i for i, _ in candidates])
        except (ValueError, KeyError, TypeError):
            raise ExtractionError(
                f"self extractor: the decision ended ({finish}) before its JSON did",
                transient=False,
                kind="length",
            ) from None

    def decide(
        self,
        store: Any,
        user_id: str,
        facts: list[Fact],
        said: dict[str, str],
        num_candidates: int | None = None,
    ) -> tuple[list[Any], list[Any], list[Any], list[Any]]:
        """The formation worker's decider (scheduler.formation): each fact's event against the user's current
        memories most like it (the store's dense search), applied by `apply_updates`."""
        k = num_candidates or self.num_candidates
        decisions = []
        for fact in facts:
            hits = store.search(user_id, fact.text, top_k=min(k, self.num_candidates), mode="dense")
            candidates = [(h.memory.id, h.memory.text) for h in hits]
            decisions.append(self.guard(fact, self.decide_one(fact, candidates), candidates))
        with self._lock:
            for fact in facts:
                for t in fact.turn_ids:
                    self._said.pop(t, None)
        said_at = [max((said.get(t, "") for t in f.turn_ids), default="") for f in facts]
        return apply_updates(facts, decisions, said_at)

    def guard(
        self, fact: Fact, decision: UpdateDecision, candidates: Sequence[tuple[str, str]] = ()
    ) -> UpdateDecision:
        """The decision, or, for an update or delete the fact's turns cannot stand behind (change_guard.py),
        an add (a restatement: none, naming the same memory); for one whose fact sets a slot of another area
        than the memory it names (`candidates`: the (id, text) the model was shown), the same event naming
        the first shown memory of the fact's area, else an add."""
        if decision.event not in ("update", "delete") or decision.target is None:
            return decision
        with self._lock:
            texts = [self._said[t] for t in fact.turn_ids if t in self._said]
        reason = turn_blocker(fact.text, texts) if texts else None
        if reason is None and same_value(fact.text, dict(candidates).get(decision.target) or ""):
            reason = "restatement"  # the same slot and value as the memory it would retire
        if reason is None:
            decision, reason = _same_area(fact.text, decision, candidates)
            if reason is None:
                return decision
        with self._lock:
            self.guarded[reason] += 1
        log.debug("self extractor: %s of %r turned (%s)", decision.event, fact.text, reason)
        if reason == "restatement":
            return UpdateDecision("none", decision.target)
        return decision if reason == "other slot, retargeted" else UpdateDecision("add")


def atomic(fact: Fact, cut: bool) -> list[Fact]:
    """A model's fact as the rules' statements in it, one fact each (the rules' guard over the reply): the
    small models copy the user's sentences, several at a time, so a fact held "I've been busy with work and
    catching up with friends. It was my last day of school"; split as the rule extractor splits a turn
    (clauses.statements, then atoms), with questions, filler and hedges dropped. A fact with no first-person
    word in it stays as written (a model may write "Ana has a dog"), unless it is a question or was cut.
    `cut`: the schema's bound cut the text (`was_cut`), so a statement that ends the text ends where the bound cut it
    ("and layered them with a") and is dropped when others stand. The slot and value stay on the statement
    that names the value (else the first)."""
    pieces = [sentence_case(a) for clause in statements(fact.text) for a in atoms(clause.text)]
    if not pieces:  # filler, a question, a hedge; or a fact not in the first person ("Ana has a dog")
        whole = not cut and not fact.text.rstrip().endswith("?")
        return [fact] if whole and not _FIRST_PERSON.search(fact.text) else []
    if cut and len(pieces) > 1 and _words(fact.text)[-len(_words(pieces[-1])) :] == _words(pieces[-1]):
        pieces.pop()  # it ends the text: the bound cut it
    value = (fact.value or "").lower()
    named = next((p for p in pieces if value and value in p.lower()), pieces[0])
    return [
        replace(fact, text=p) if p == named else replace(fact, text=p, slot=None, value=None) for p in pieces
    ]


def was_cut(text: str) -> bool:
    """Whether the facts schema's bound (`_TEXT_MAX`) cut `text`: it reached the bound, or ended within
    `_CUT_MARGIN` of it on no end punctuation."""
    return len(text) >= _TEXT_MAX or (
        len(text) >= _TEXT_MAX - _CUT_MARGIN and not text.rstrip().endswith(_ENDS)
    )


_FIRST_PERSON = re.compile(r"\b(?:i|i'm|i've|i'd|i'll|me|my|mine|myself|we|our|us)\b", re.I)


def _words(text: str) -> list[str]:
    return re.findall(r"[\w']+", text.lower())


def _same_area(
    fact_text: str, decision: UpdateDecision, candidates: Sequence[tuple[str, str]]
) -> tuple[UpdateDecision, str | None]:
    """The slot check over an update or delete (change_guard.other_area): (the decision, None) where it
    stands; (the same event naming the first candidate of the fact's area, "other slot, retargeted"); or
    (the decision, "other slot") where no candidate is of the fact's area."""
    texts = dict(candidates)
    if decision.target not in texts or not other_area(fact_text, texts[decision.target]):
        return decision, None
    area = slot_area(fact_text)
    for memory_id, text in candidates:
        if memory_id != decision.target and slot_area(text) == area:
            return UpdateDecision(decision.event, memory_id), "other slot, retargeted"
    return decision, "other slot"


_SAID_MAX = 4096


def _as_context(turn: TurnInput) -> TurnInput:
    from dataclasses import replace

    return replace(turn, role="context")
