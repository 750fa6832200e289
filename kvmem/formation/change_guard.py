"""Whether a user's turn can stand behind a supersession: the rules' guard over the "self" extractor's
update and delete decisions (self_model.py).

The served model reads "update" into sentences that change nothing: scored once on the sealed held-out set
(benchmarks/data/state_changes, 2026-11-28), the demo model superseded a memory for 52 of 109 non-changes,
among them another person's move, a plan, a negated change, a restatement and an addition. What it
decides stands only where the clause the fact came from reads as the user's own change, here and now;
otherwise the decision is the model's fact added beside the memory (or, for a restatement, joined to the
memory it names). The reading is lexical, like the rest of the rules: a change must be said with a word of
change, and nothing else about it is asked; past that, it says what is not a change, not what is one.

`blocker(clause)`, per clause, one of BLOCKERS or None:
- "another person": the subject is someone else ("my sister ...", "our neighbours ...") and the user is
  not in the clause ("my wife left me", "my boyfriend and I split up" are the user's);
- "negated": a negation with no word saying the state ended ("I didn't take the job" blocks; "I don't eat
  meat anymore", "I no longer work there" do not);
- "plan": an intention or a possibility, not a change yet ("I'm going to apply", "thinking of moving");
- "restatement": "still", "like I said", "same as ever";
- "addition": a second thing beside the first ("also", "another", "a side job", "as well", a closing "too";
  not "too" before a word: "we broke up, the distance was too hard" is a change);
- "no change word": nothing in the clause says a state began, ended or moved (`change_words.CHANGED`: moved, quit,
  started, retired, split, gave up, took up, "for N years", "now", "no longer" ...). Scored once on the third
  sealed set, the model's updates stood on clauses such as "we took her out for a curry to celebrate" (a
  teacher's job retired) and "I always check the labels" (retiring "I'm vegan"): 21 of 109 non-changes
  superseded a memory, most through a clause that blocked nothing. A change of state is said with a change
  word; the list is general English for the areas the rules read, and a change said without one (rare in the
  sets: "I'm FREE") is kept beside the old memory rather than retiring it. Scored once on the fourth sealed
  set (b31e378), it turned 51 of the model's updates: false supersessions 0.07 there, changes caught 0.58
  (0.19 and 0.78 on the third; docs/benchmarks.md): precision bought with recall.

A "plan" is also a clause about a time still to come: "next ..." (not "the next ..."), "tomorrow", "this
coming ...", or "in <month or season>" with the words before it in the present ("I start law school in
September", "we're moving to Nice in March"), not the past ("I moved in March"; "I retired in March and am
loving it" has its present after the date).

`turn_blocker(fact_text, turn_texts)` picks the clauses of the turns that share the most words with the
fact (all of them where none shares one) and returns None when any of those reads as a change, else the
first one's blocker ("no statement" where the turns hold no first-person statement at all).

`same_value(fact_text, memory_text)`: the rules read the same slot and value in both ("I've lived in Kyoto for
six years now" over "I live in Kyoto"): the update restates the memory.

`other_area(fact_text, memory_text)`: the slot check. On the second sealed set the model's updates that the
clause check let through superseded the other earlier memory in 30 of the change items (a new job retiring
where the user lives): where the rules read a slot in both the fact and the memory the model named (rules.slot_of)
and the slots are of different areas (job and employer are one area, "work"; the relationship and a partner's
name, "partner"; diet and tastes, "taste"), the update cannot stand. It errs the same way: where the rules
read no slot in either, it says nothing.
"""

from __future__ import annotations

import re

from kvmem.formation.change_words import CHANGED, says_change
from kvmem.formation.clause_subject import subject_core
from kvmem.formation.clauses import statements
from kvmem.formation.dates import MONTHS, WEEKDAYS
from kvmem.formation.lexicon import (
    ED_NOT_PAST,
    JOKED_PARTNERS,
    PARTNER_NOUNS,
    PAST_VERBS,
    RELATIVES,
    STOP_WORDS,
)
from kvmem.formation.rules import slot_of

BLOCKERS = ("another person", "negated", "plan", "restatement", "addition", "no change word", "no statement")

_PEOPLE = sorted(
    {*RELATIVES, "parents", "kids", "children", "ex", "manager", "teammate", "landlord",
     "housemate", "partner's", "in-laws", "niece", "nephew", "grandparents", "twin", "stepmom", "stepdad",
     "mate", "deskmate", "classmate", "buddy", "pal", "bff", "bestie", "lad", "lass", "boy", "girl", "kid",
     "eldest", "youngest", "oldest", "missus", "hubby", "folks", "bf", "gf", "grandad", "granddad", "gran", "nan", "nana",
     "sergeant", "lodger", "tenant", "godson", "goddaughter", "godmother", "godfather", "stepson", "stepdaughter",
     "stepmum", "sister-in-law", "brother-in-law", "mother-in-law", "father-in-law", "son-in-law", "daughter-in-law",
     "grandson", "granddaughter", "grandkids", "grandchildren", "apprentice", "employee", "supervisor", "mentor",
     "roomie", "auntie", "aunty", "trainee", "stepbrother", "stepsister"},
    key=len,
    reverse=True,
)  # fmt: skip
_THIRD = r"(?:he|she|they)"  # a third person's pronoun
# another person as the subject: one of _PEOPLE ("my next-door neighbours", "our youngest"), or a third person's pronoun
# ("He moved to Leeds", "She's quit")
_OTHER = re.compile(
    rf"^(?:(?:my|our)(?: (?:best|older|younger|little|big|elder|new|old|ex|twin|step|oldest|youngest|\w+'s|"
    rf"\w+(?:-\w+)+))* )?(?:{'|'.join(re.escape(p) for p in _PEOPLE)})s?\b|^{_THIRD}(?:'s|'ve|'re|'d)?\b",
    re.I,
)
# a third person's pronoun whose news is the user's partnership: "He proposed", "She said yes", "He asked me out"
_PARTNERS_NEWS = re.compile(
    rf"^{_THIRD}\b.*\b(?:propos\w+|popped the question|said yes|asked (?:me|us) out|moved in with (?:me|us))\b",
    re.I,
)
_USER_IN_IT = re.compile(r"\b(?:me|us|I)\b")  # case matters: "I" (normalized), not a word beginning with "i"
# a partner's news can be the user's ("my wife left me", "my girlfriend moved in with us"); anyone else's is the user's
# only with the user a subject beside them ("my sister and I moved"): "my son's come to work with me" is the son's
_PARTNERS = re.compile(
    r"^(?:(?:my|our) )?(?:(?:new|late|lovely|dear|darling|current)[ -])?(?:wife|husband|partner|boyfriend|"
    r"girlfriend|fianc\w*|spouse|missus|hubby|bf|gf|ex)s?\b(?!')",  # the subject: not "my daughter and her husband"
    re.I,
)
_JOINT = re.compile(r"^(?:[\w'-]+ ){0,3}(?:and|&) (?:I|me)\b")
# a memory of the user's partner as theirs ("My partner Lou is a sound engineer", "My wife and I run a B&B")
_NAMES_PARTNER = re.compile(
    r"^(?:me and )?(?:my|our) (?:(?:new|lovely|dear|darling|current)[ -])?(?:wife|husband|partner|boyfriend|girlfriend|fianc\w*|"
    r"spouse|missus|hubby|bf|gf|other half)\b(?!['-])(?! (?:at|in crime|in business|from work)\b)",
    re.I,
)
_EMPLOYS_USER = re.compile(
    r"\b(?:promoted me|hired me|took me on|taken me on|kept me on|offered me the job|made me|let (?:me|us) go|"
    r"(?:moved|transferred|posted|relocated) (?:me|us) to|"
    r"laid (?:me|us) off|fired (?:me|us)|sacked (?:me|us))\b",
    re.I,
)
_ALONGSIDE = re.compile(r"\b(?:as|than) (?:me|us)\b", re.I)  # "at the same firm as me": a comparison
# and a change weighed and not made: "decided against moving", "talked myself out of it", "turned the offer down"
_NEGATION = re.compile(
    r"\b(?:not|never|nope|nah|decided against|talked (?:myself |me |us )?out of|changed (?:my|our) minds?|"
    r"turned (?:\w+ ){0,3}down|(?:pulled|backed) out of|fell through|tried (?:to )?(?:giv(?:e|ing)|quit(?:ting)?|"
    r"stop(?:ping)?|cut(?:ting)?|ditch(?:ing)?|drop(?:ping)?)|(?:nearly|almost) (?:moved|quit|left|sold|"
    r"took|gave|went|broke|split|retired|resigned|married|signed|bought|emigrated|relocated|dropped|stopped|ditched|"
    r"cancell?ed))\b|n't\b",
    re.I,
)
# a negation that tells a state ended is a change: "not ... anymore", "no longer", "never looked back"
_ENDED = re.compile(
    r"\b(?:any ?more|no longer|no more|nowadays|these days|now|since|ever since|never looked back|never again|"
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
    r"thinking (?:about|of)|tempted|dream(?:ing|t|ed)? (?:of|about|that)|"
    r"(?:had|have) an? (?:\w+ )?(?:dream|nightmare)"
    r"(?= (?:that|about|last|where|on|in which|of)\b|\s*[,.!]|$)|"
    r"(?:on|taking|take|taken) (?:\w+ ){0,4}leave|sabbatical|someday|"
    # a stay for a while is no lasting change ("I have shifted to my auntie's place for the holidays")
    r"for the (?:holidays|summer|winter|week|weekend|month|night|term|festive season|time being)|"
    r"(?:last|final|first) (?:day|shift|week|lesson|class)(?: [\w']+){0,4} (?:is|'s|will be)|"
    r"(?:accepted|signed) (?:an|the|a|my) (?:\w+ )?offer|one day|eventually|"
    r"appl(?:y|ied|ying) (?:for|to)|interview(?:ed|ing)? (?:for|at|with)|looking (?:for|into|at)|"
    r"on the cards|in the works|weighing|wonder(?:ing)? (?:about|if|whether)|(?-i:may))\b",
    re.I,
)
_RESTATED = re.compile(
    r"\b(?:still|staying put|stay(?:ing)? where I am|not going anywhere|like I said|as I said|"
    r"as I (?:mentioned|told you)|like I (?:mentioned|told you)|"
    r"same as (?:ever|always|before)|as (?:always|usual|ever)|same old|(?:has|have)n't changed|"
    r"nothing(?:'s| has) changed|(?:already )?(?:told|mentioned)(?: it)? before)\b",
    re.I,
)
# "too" as "also" ends its phrase ("I've taken up climbing too", "... too and love it"); before another word it
# is "too hard", "too pricey"
_CONCESSIVE = re.compile(r",\s*(?:though|although|even though|even if)\b", re.I)
_ADDED = re.compile(
    r"\b(?:holiday (?:home|place|house|cottage|flat|let|shack|cabin|caravan|chalet|villa|apartment)|"
    r"for (?:the )?weekends|picked up (?:some|a few|extra|a bit of)|"
    r"also|too(?=\s*(?:[,.!?;:)]|$|(?:and|but|so|now|lol|haha|tbh|though|these days)\b))|as well|another|a second|in addition|on top of|besides|along ?side|along with|side (?:job|gig|"
    r"hustle|project)|on the side)\b",
    re.I,
)
_MONTH = "|".join(MONTHS)
_SEASON = "spring|summer|autumn|fall|winter|new year"
# a time still to come: always ("next month"), or said in the present ("I start in September")
_AHEAD = re.compile(
    rf"\b(?:(?<!the )next (?:week|weekend|month|year|term|semester|{_SEASON}|{_MONTH}|{'|'.join(WEEKDAYS)})|tomorrow|"
    rf"this coming|in a (?:few|couple of) (?:weeks|months)|in (?:\w+ )?(?:weeks|months)' time)\b",
    re.I,
)
_DATED = re.compile(
    rf"\b(?:(?:in|from|come|by|until) (?:the )?(?:{_SEASON}|{_MONTH})|(?:from|come|by|until) (?:{'|'.join(WEEKDAYS)}))\b",
    re.I,
)
# a day, read over the whole clause (a resolved date often leads it: "On 2026-11-25 I got the keys"): "on the 4th",
# "Friday the 28th, then ...", "the 12th of June" (not "the 3rd floor"), "at the end of March" (not "since the end of
# March"), "in the week of 2026-05-11"
_DAY = re.compile(
    r"\bthe \d{1,2}(?:st|nd|rd|th)\b(?!\s+(?!(?:of|and|but|so|then|at|in|for|when|with)\b)[a-z])"
    rf"|\b(?:at|by|until|from) the end of (?:{_MONTH})\b"
    r"|\b(?:on|from|in|by) (?:the (?:week|weekend|morning|afternoon|evening|night) of )?\d{4}-\d\d-\d\d\b",
    re.I,
)
# before the date: "we're moving ... in March" (not "I moved in March and am loving it": that one is after it)
_ING_NOUNS = (
    "thing|nothing|something|anything|everything|spring|morning|evening|wedding|building|ceiling|during"
)
_PROGRESSIVE = re.compile(rf"(?:'m|'re|\bam|\bare|\bis) (?:\w+ )?(?!(?:{_ING_NOUNS})\b)\w{{2,}}ing\b", re.I)
_ED_NOT_PAST = "|".join(sorted(ED_NOT_PAST | {"fred", "ned", "sled", "shred"}))  # "the Red Cross"
_PAST = re.compile(rf"\b(?:(?!(?:{_ED_NOT_PAST})\b)\w+ed|{'|'.join(PAST_VERBS)}|was|were|last|ago)\b", re.I)
# "-ed" words that are no past: "I'm excited to start", "we get married in June"
_NOT_PAST = re.compile(
    r"\b(?:get|getting|be|being|'m|am|are|'re|is|'s) (?:\w+ )?(?:excited|scheduled|supposed|planned|booked|"
    r"married|engaged|interested|expected|pleased|thrilled|nervous|due)\b|\bneed(?:s|ed)? to\b",
    re.I,
)
_WORD = re.compile(r"[a-z][a-z']+")


def _users_news(core: str) -> bool:
    """Whether a clause whose subject is another person ("my wife ...", "my son ...") tells news of the user's
    own: the user a subject beside them, the user's job given by them ("my manager promoted me to ..."), or for
    a partner, the user in it before its first comma, not only in a comparison ("my husband left me", not "my
    husband got a job at the same firm as me")."""
    rest = core[core.find(" ") + 1 :] if " " in core else ""
    if _JOINT.match(rest) or _EMPLOYS_USER.search(rest):
        return True
    if not _PARTNERS.match(core):
        return False
    head = _ALONGSIDE.sub(" ", rest.split(",", 1)[0])
    return bool(_USER_IN_IT.search(head))


def names_partner(text: str, name: str | None = None) -> bool:
    """Whether a memory is told of the user's partner as theirs ("My partner Lou is a sound engineer there too",
    "My wife and I run a B&B"; not "my partner at work"): one a break-up retires where the head reads the memory in
    no area; with `name` (lowercased, `partner_named_in_ending`), only one that names them."""
    return bool(_NAMES_PARTNER.match(text)) and (
        name is None or name in re.findall(r"[^\W\d_]+", text.lower())
    )


# a partnership ended: what lets a memory of the partner (names_partner) be retired
_ENDS_PARTNERSHIP = re.compile(
    # ("me and the wife", "the missus and I": as "we", said last: not "Me and the wife are done, time for bed")
    rf"^(?:(?P<we>we|I|me and (?:the|my) {PARTNER_NOUNS}|the (?:gf|bf|missus|wife|husband|hubby|other half) and "
    r"(?:I|me))|"
    rf"(?!(?:{JOKED_PARTNERS}) )(?P<name>(?-i:[A-Z])[a-z]+) and (?:I|me)|"
    rf"me and (?!(?:{JOKED_PARTNERS})\b)(?P<name2>[a-z]+)|"
    r"(?:my|our) (?:wife|husband|partner|boyfriend|girlfriend|fianc\w*|other half)(?: and I)?)"
    r"(?:'ve| have|'re| are| aren't|'s| has)? (?:just |finally |officially |now )?(?:split up|split|broken? up|"
    r"separated|separating|divorced|got divorced|called it (?:a day|quits)|done|over|finished|left me|dumped me|"
    r"ended things|(?:decided to )?part(?:ed)? ways|(?:not )?(?:a (?:thing|couple|item)|together) any ?more)"
    # said last or after a day; with a name or the partner as subject also before a comma ("Rory and I are done,
    # it's been coming a while"; not "We've split up for the day", "We split the bill", "We're done, time for lunch")
    r"(?:\s+(?:on \d{4}-\d\d-\d\d|in the week of \d{4}-\d\d-\d\d|yesterday|today|last (?:week|month|night)))?"
    r"(?:\s*$|(?(we)(?!)|,\s))",
    re.I,
)


def partner_named_in_ending(text: str) -> str | None:
    """The partner a statement of a partnership ended names as its subject, lowercased ("Rory and I are done" ->
    "rory"); None where it names none ("We broke up") or tells no ending."""
    m = _ENDS_PARTNERSHIP.search(text)
    name = m and (m.group("name") or m.group("name2"))
    return name.lower() if name and name.lower() not in ("my", "our") else None


def ends_partnership(text: str) -> bool:
    """Whether a statement tells the user's partnership ended ("Lou and I have separated", "Alex and I have called it
    a day"), not that one began or goes on."""
    return bool(_ENDS_PARTNERSHIP.search(text))


def tells_change(clause: str, strict: bool = False) -> bool:
    """Whether the clause tells a change of the user's own: `blocker` lets it through and it `says_change`."""
    return blocker(clause) is None and says_change(clause, strict)


# a way of speaking, not a negation or a plan: "Not gonna lie, ...", "Not to be dramatic but ..."
_ASIDE = re.compile(r"\bnot (?:gonna|going to) lie\b|\bnot to be dramatic\b", re.I)


def blocker(clause: str) -> str | None:
    """Why this clause cannot supersede a memory of the user (one of BLOCKERS), or None."""
    clause = _ASIDE.sub(" ", clause)
    core = subject_core(clause) or clause
    if _OTHER.match(core) and not _users_news(core) and not _PARTNERS_NEWS.match(core):
        return "another person"
    # the whole clause before a concessive: "Still no meat for me" leads with it; "not going anywhere"; not "Got the
    # keys to a terrace in Cleethorpes, though my clothes still smell of vinegar"
    if _RESTATED.search(_CONCESSIVE.split(clause, maxsplit=1)[0]):
        return "restatement"
    if _NEGATION.search(core) and not _ENDED.search(clause) and not _NEGATED_TASTE.search(core):
        return "negated"  # _ENDED on the whole clause: "Since March I don't eat meat" leads with it
    if _PLAN.search(core) or _ahead(clause):
        return "plan"
    if _ADDED.search(core):
        return "addition"
    if not CHANGED.search(clause):
        return "no change word"
    return None


def _ahead(clause: str) -> bool:
    """A time still to come: "next month" in any tense (not "the next month"), or "in September" with the
    words before it in the present ("I start law school in September", "we're moving to Nice in March"), not
    the past ("I moved in March", "I retired in March and am loving it")."""
    if _AHEAD.search(clause):
        return True
    dated = _DATED.search(clause)
    if dated is not None:
        before = _NOT_PAST.sub(" ", clause[: dated.start()])
        return bool(_PROGRESSIVE.search(before)) or not _PAST.search(before)
    day = _DAY.search(clause)
    if day is None:
        return False
    rest = _NOT_PAST.sub(" ", f"{clause[: day.start()]} {clause[day.end() :]}")
    return bool(_PROGRESSIVE.search(rest)) or not _PAST.search(rest)


def _words(text: str) -> set[str]:
    return {w for w in _WORD.findall(text.lower()) if w not in STOP_WORDS}


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


def area_of_slot(slot: str) -> str:
    """A slot's area: "work" for the job and the employer, "partner", "taste", else the slot's own family."""
    family = slot.split(":", 1)[0]
    return _AREAS.get(family, family)


def slot_area(text: str) -> str | None:
    """The area of the slot `text` sets as the rules read it (rules.slot_of), or None where they read none."""
    found = slot_of(text)
    return None if found is None else area_of_slot(found[0])


def same_value(fact_text: str, memory_text: str) -> bool:
    """True where the rules read the same slot and value in both texts: the fact restates the memory."""
    fact = slot_of(fact_text)
    return fact is not None and fact == slot_of(memory_text)


def other_area(fact_text: str, memory_text: str) -> bool:
    """True where the rules read a slot in both texts and the slots are of different areas: the fact cannot
    retire that memory (a new job does not end where the user lives). False where either reads none: the
    check then has nothing to say."""
    fact_area, memory_area = slot_area(fact_text), slot_area(memory_text)
    return fact_area is not None and memory_area is not None and fact_area != memory_area
