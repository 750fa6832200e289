"""Whether a user's turn can stand behind a supersession: the rules' guard over the "self" extractor's
update and delete decisions (self_model.py).

The served model reads "update" into sentences that change nothing: scored once on the sealed held-out set
(benchmarks/data/state_changes, 2026-11-28), the demo model superseded a memory for 52 of 109 non-changes,
among them another person's move, a plan, a negated change, a restatement and an addition. What it
decides stands only where the clause the fact came from reads as the user's own change, here and now;
otherwise the decision is the model's fact added beside the memory (or, for a restatement, joined to the
memory it names). The reading is lexical, like the rest of the rules, and errs toward letting a change
through when nothing blocks it: it says what is not a change, not what is one.

`blocker(clause)`, per clause, one of BLOCKERS or None:
- "another person": the subject is someone else ("my sister ...", "our neighbours ...") and the user is
  not in the clause ("my wife left me", "my boyfriend and I split up" are the user's);
- "negated": a negation with no word saying the state ended ("I didn't take the job" blocks; "I don't eat
  meat anymore", "I no longer work there" do not);
- "plan": an intention or a possibility, not a change yet ("I'm going to apply", "thinking of moving");
- "restatement": "still", "like I said", "same as ever";
- "addition": a second thing beside the first ("also", "another", "a side job", "as well").

`turn_blocker(fact_text, turn_texts)` picks the clauses of the turns that share the most words with the
fact (all of them where none shares one) and returns None when any of those reads as a change, else the
first one's blocker ("no statement" where the turns hold no first-person statement at all).

`other_area(fact_text, memory_text)`: the slot check. On the second sealed set the model's updates that the
clause check let through superseded the other earlier memory in 30 of the change items (a new job retiring
where the user lives): where the rules read a slot in both the fact and the memory the model named (rules.slot_of)
and the slots are of different areas (job and employer are one area, "work"; the relationship and a partner's
name, "partner"; diet and tastes, "taste"), the update cannot stand. It errs the same way: where the rules
read no slot in either, it says nothing.
"""

from __future__ import annotations

import re

from kvmem.formation.clauses import statements, subject_core
from kvmem.formation.lexicon import RELATIVES
from kvmem.formation.rules import slot_of

BLOCKERS = ("another person", "negated", "plan", "restatement", "addition", "no statement")

_PEOPLE = sorted(
    {*RELATIVES, "parents", "kids", "children", "ex", "manager", "teammate", "landlord",
     "housemate", "partner's", "in-laws", "niece", "nephew", "grandparents", "twin", "stepmom", "stepdad",
     "mate", "buddy", "pal", "bff"},
    key=len,
    reverse=True,
)  # fmt: skip
_OTHER = re.compile(
    rf"^(?:my|our)(?: (?:best|older|younger|little|big|elder|new|old|ex|twin|step|oldest|youngest|\w+'s))*"
    rf" (?:{'|'.join(re.escape(p) for p in _PEOPLE)})s?\b",
    re.I,
)
_USER_IN_IT = re.compile(r"\b(?:me|us|I)\b")  # case matters: "I" (normalized), not a word beginning with "i"
_NEGATION = re.compile(r"\b(?:not|never|nope|nah)\b|n't\b", re.I)
# a negation that tells a state ended is a change: "not ... anymore", "no longer", "never looked back"
_ENDED = re.compile(
    r"\b(?:any ?more|no longer|nowadays|these days|now|since|ever since|never looked back|never again|"
    r"not going back|never going back|for good)\b",
    re.I,
)
# a negation that is a taste, not a negation of a change: "I can't stand coffee", "can't get enough of it"
_NEGATED_TASTE = re.compile(
    r"\b(?:can't|cannot|couldn't) (?:stand|bear|get enough|live without|imagine)\b", re.I
)
_PLAN = re.compile(
    r"\b(?:going to (?!(?:the|a|an|my|our|church|school|work|bed|class|classes|the gym|gym)\b)|gonna|will|"
    r"'ll|plan(?:ning)? (?:to|on)|about to|intend(?:ing)? to|hop(?:e|ing) to|want(?:ing)? to|wanna|"
    r"(?:would|'d) (?:like|love) to|might|could|maybe|perhaps|possibly|probably|consider(?:ing)?|"
    r"thinking (?:about|of)|tempted|dream(?:ing)? (?:of|about)|someday|one day|eventually|"
    r"appl(?:y|ied|ying) (?:for|to)|interview(?:ed|ing)? (?:for|at|with)|looking (?:for|into|at)|"
    r"on the cards|in the works|weighing|(?-i:may))\b",
    re.I,
)
_RESTATED = re.compile(
    r"\b(?:still|like I said|as I said|as I (?:mentioned|told you)|like I (?:mentioned|told you)|"
    r"same as (?:ever|always|before)|as (?:always|usual|ever)|same old|(?:has|have)n't changed|"
    r"nothing(?:'s| has) changed|(?:already )?(?:told|mentioned)(?: it)? before)\b",
    re.I,
)
_ADDED = re.compile(
    r"\b(?:also|too|as well|another|a second|in addition|on top of|besides|side (?:job|gig|"
    r"hustle|project)|on the side)\b",
    re.I,
)
_WORD = re.compile(r"[a-z][a-z']+")
_STOP = frozenset(
    "i i'm i've my me we our the a an to of in on at for and but or is am are was were be been have has had "
    "do does did it its this that with as now so just user user's they their".split()
)


def blocker(clause: str) -> str | None:
    """Why this clause cannot supersede a memory of the user (one of BLOCKERS), or None."""
    core = subject_core(clause) or clause
    if _OTHER.match(core) and not _USER_IN_IT.search(core[core.index(" ") :]):
        return "another person"
    if _NEGATION.search(core) and not _ENDED.search(core) and not _NEGATED_TASTE.search(core):
        return "negated"
    if _PLAN.search(core):
        return "plan"
    if _RESTATED.search(core):
        return "restatement"
    if _ADDED.search(core):
        return "addition"
    return None


def _words(text: str) -> set[str]:
    return {w for w in _WORD.findall(text.lower()) if w not in _STOP}


def turn_blocker(fact_text: str, turn_texts: list[str]) -> str | None:
    """Why the fact's turns cannot stand behind a supersession, or None (see the module docstring)."""
    clauses = [c.text for t in turn_texts for c in statements(t)]
    if not clauses:
        return "no statement"
    fact = _words(fact_text)
    overlap = [len(fact & _words(c)) for c in clauses]
    best = max(overlap)
    picked = [c for c, n in zip(clauses, overlap, strict=True) if n == best]
    reasons = [blocker(c) for c in picked]
    return None if None in reasons else reasons[0]


# ---- the slot check: does the fact set what the memory it would retire sets? --------------------------------

# slots that one change of state moves together, read as one area: a new job changes the employer, a move the
# city, a break-up the partner's name, a new diet a taste. Any other slot is its own area (before any ":"), so
# "sister|home_city" is not "user|home_city" and "user|dog.name" is not "user|job".
_AREAS = {
    "user|job": "work",
    "user|employer": "work",
    "user|relationship": "partner",
    **{f"{who}|name": "partner" for who in ("wife", "husband", "partner", "girlfriend", "boyfriend",
                                             "fiance", "fiancee", "fiancé", "fiancée", "spouse")},
    "user|diet": "taste",
    "user|likes": "taste",
    "user|favourite": "taste",
}  # fmt: skip


def slot_area(text: str) -> str | None:
    """The area of the slot `text` sets as the rules read it (rules.slot_of), or None where they read none."""
    found = slot_of(text)
    if found is None:
        return None
    family = found[0].split(":", 1)[0]
    return _AREAS.get(family, family)


def other_area(fact_text: str, memory_text: str) -> bool:
    """True where the rules read a slot in both texts and the slots are of different areas: the fact cannot
    retire that memory (a new job does not end where the user lives). False where either reads none: the
    check then has nothing to say."""
    fact_area, memory_area = slot_area(fact_text), slot_area(memory_text)
    return fact_area is not None and memory_area is not None and fact_area != memory_area
